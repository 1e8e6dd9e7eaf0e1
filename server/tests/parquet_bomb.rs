//! Parquet bombs through the API, in a process whose peak resident memory is measured: a 13 KB
//! file whose one zstd cell inflates to 400 MiB, and a 19 KB file of five million rows. Both
//! uploads are refused with 422 and the limit they broke named, and so is a preview of a stored
//! dataset whose file is (by now) the bomb, with the process far below the bomb's size. Its own
//! test binary, so the peak it reads is this test's alone; the bombs are built first, and the
//! peak is reset (`/proc/self/clear_refs`) before the appliance sees them.

use std::sync::Arc;
use std::time::Instant;

use axum::http::StatusCode;
use parquet::basic::Compression;
use parquet::data_type::{ByteArray, ByteArrayType};
use parquet::file::properties::{EnabledStatistics, WriterProperties};
use parquet::file::writer::SerializedFileWriter;
use parquet::schema::parser::parse_message_type;

#[path = "api/common.rs"]
#[allow(dead_code)]
mod common;

use common::TestApp;

/// What the whole process may reach while the appliance reads the bombs.
const PEAK_RSS_BYTES: u64 = 300_000_000;

/// A Parquet file of one zstd-compressed `text` column written from `batches`.
fn parquet(batches: impl IntoIterator<Item = Vec<ByteArray>>, dictionary: bool) -> Vec<u8> {
    let schema = "message schema { REQUIRED BYTE_ARRAY text (UTF8); }";
    let schema = Arc::new(parse_message_type(schema).expect("schema"));
    let props = WriterProperties::builder()
        .set_compression(Compression::ZSTD(Default::default()))
        .set_dictionary_enabled(dictionary)
        .set_statistics_enabled(EnabledStatistics::None)
        .build();
    let mut writer =
        SerializedFileWriter::new(Vec::new(), schema, Arc::new(props)).expect("writer");
    let mut group = writer.next_row_group().expect("row group");
    let mut column = group.next_column().expect("column").expect("a column");
    for batch in batches {
        column.typed::<ByteArrayType>().write_batch(&batch, None, None).expect("batch");
    }
    column.close().expect("column");
    group.close().expect("row group");
    writer.into_inner().expect("file")
}

/// The process's peak resident set (`VmHWM`), in bytes.
fn peak_rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).expect("VmHWM");
    let kib: u64 = line.split_whitespace().nth(1).and_then(|n| n.parse().ok()).expect("a number");
    kib * 1024
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parquet_bombs_are_refused_in_bounded_memory() -> anyhow::Result<()> {
    let inflating = parquet([vec![ByteArray::from(vec![b'a'; 400 << 20])]], false);
    let many_rows = parquet(std::iter::repeat_n(vec![ByteArray::from("x"); 500_000], 10), true);
    let good =
        parquet([vec![ByteArray::from("Once upon a time."), ByteArray::from("The end.")]], false);
    assert!(inflating.len() < 32 << 10, "the bomb is {} bytes", inflating.len());
    assert!(many_rows.len() < 32 << 10, "the rows are {} bytes", many_rows.len());
    eprintln!(
        "bombs: {} bytes inflating to 400 MiB, {} bytes of 5000000 rows",
        inflating.len(),
        many_rows.len()
    );
    // Building the bomb held its 400 MiB: the peak starts again from here.
    std::fs::write("/proc/self/clear_refs", "5")?;
    let before = peak_rss();

    let app = TestApp::new().await?;
    let admin = app.admin().await?;
    let started = Instant::now();
    let reply = admin.upload("bomb.parquet", &inflating, None).await?;
    assert_eq!(reply.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", reply.text());
    assert_eq!(
        reply.error(),
        "not a usable dataset: column \"text\" has a page that inflates to 400.0 MiB, more \
         than the 32.0 MiB a page may be"
    );
    let reply = admin.upload("rows.parquet", &many_rows, None).await?;
    assert_eq!(reply.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", reply.text());
    assert_eq!(
        reply.error(),
        "not a usable dataset: the file has 5000000 rows, more than the 2000000 a Parquet \
         dataset may have"
    );
    let uploads = started.elapsed();

    // A dataset kept earlier whose file is now the bomb: its preview refuses it the same way.
    let reply = admin.upload("good.parquet", &good, None).await?;
    assert_eq!(reply.status, StatusCode::CREATED, "{}", reply.text());
    let id = reply.json()?["id"].as_i64().expect("id");
    let stored: Vec<_> = std::fs::read_dir(app.state.datasets_dir())?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "parquet"))
        .collect();
    assert_eq!(stored.len(), 1, "{stored:?}");
    std::fs::write(&stored[0], &inflating)?;
    let preview = admin.get(&format!("/api/datasets/{id}/preview?model=preset:tiny")).await?;
    assert_eq!(preview.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", preview.text());
    assert!(
        preview.error().contains("inflates to 400.0 MiB, more than the 32.0 MiB a page may be"),
        "{}",
        preview.text()
    );

    let peak = peak_rss();
    eprintln!(
        "two uploads refused in {uploads:.1?}; peak RSS {:.0} MB (at the reset {:.0} MB)",
        peak as f64 / 1e6,
        before as f64 / 1e6
    );
    assert!(peak < PEAK_RSS_BYTES, "peak RSS {peak} bytes, over {PEAK_RSS_BYTES}");
    Ok(())
}
