//! What every GPU test shares: the GPU, the parity table, random inputs, buffers on either
//! backend, and the small batch most ops run on.

pub(crate) use crate::cases;
pub(crate) use std::collections::BTreeMap;
pub(crate) use std::path::PathBuf;
pub(crate) use std::sync::{Mutex, OnceLock};

pub(crate) use half::bf16;
pub(crate) use rand::{Rng, SeedableRng};
pub(crate) use rand_chacha::ChaCha8Rng;
pub(crate) use sluice_engine::backend::cpu::Cpu;
pub(crate) use sluice_engine::backend::cuda::Cuda;
pub(crate) use sluice_engine::backend::prelude::*;
pub(crate) use sluice_engine::backend::{
    Addends, AttentionOut, AttentionShape, ExpertLayout, FloatKind, GluAct, Grads, GroupedShape,
    IGNORE, LossOut, LossShape, MatmulShape, MoeShape, NormShape, Operands, RouterKind, Routing,
};
pub(crate) use sluice_engine::data::MicroBatch;
pub(crate) use sluice_engine::model::{
    Decoder, DeviceBatch, HostParams, LayerAt, LayerGrads, LayerScratch,
};
pub(crate) use sluice_engine::schedule::{
    CheckpointTier, DiskOptions, GradientTier, RING_SLOTS, ScheduleOptions, Streamer, WeightSource,
};
pub(crate) use sluice_engine::spec::{ModelSpec, preset};
pub(crate) use sluice_engine::store::HostSlab;
pub(crate) use sluice_engine::train::{TrainConfig, Trainer};

pub(crate) use FloatKind::{Accum, Activation};

pub(crate) fn gpu() -> &'static Cuda {
    static GPU: OnceLock<Cuda> = OnceLock::new();
    GPU.get_or_init(|| Cuda::new(0).unwrap_or_else(|e| panic!("opening the GPU: {e}")))
}

/// Largest error per check, printed by the last test.
pub(crate) fn table() -> &'static Mutex<BTreeMap<String, (f64, f64)>> {
    static TABLE: OnceLock<Mutex<BTreeMap<String, (f64, f64)>>> = OnceLock::new();
    TABLE.get_or_init(|| Mutex::new(BTreeMap::new()))
}

/// `max |got - want| / max |want|`; a NaN anywhere counts as infinite.
pub(crate) fn rel_err(got: &[f32], want: &[f32]) -> (f64, usize) {
    assert_eq!(got.len(), want.len(), "lengths differ");
    let scale = want.iter().fold(0f64, |m, &x| m.max(f64::from(x).abs())).max(1e-30);
    let (mut worst, mut at) = (0f64, 0);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let d = (f64::from(g) - f64::from(w)).abs() / scale;
        let d = if d.is_nan() { f64::INFINITY } else { d };
        if d > worst {
            (worst, at) = (d, i);
        }
    }
    (worst, at)
}

/// Prints and records an error for the final table.
pub(crate) fn record(what: &str, err: f64, tol: f64) {
    println!("{what:<48} max rel err {err:.3e} (tol {tol:.0e})");
    let mut t = table().lock().expect("table");
    let e = t.entry(what.to_string()).or_insert((0.0, tol));
    e.0 = e.0.max(err);
}

pub(crate) fn check(what: &str, got: &[f32], want: &[f32], tol: f64) {
    let (err, at) = rel_err(got, want);
    record(what, err, tol);
    if err > tol {
        dump(what, got, want);
    }
    assert!(
        err <= tol,
        "{what}: max relative error {err:.3e} > {tol:.0e} at {at}: gpu {} cpu {} (first pairs {:?})",
        got[at],
        want[at],
        got.iter().zip(want).take(4).collect::<Vec<_>>()
    );
}

/// Most elements a failed check writes out.
pub(crate) const DUMP_MAX: usize = 1 << 21;

/// With `SLUICE_TEST_DUMP=DIR`, writes a failed check's two tensors (little-endian f32, up to
/// `DUMP_MAX` elements each) to DIR, so the pattern of wrong elements (which rows, which
/// columns) can be studied where the GPU is not.
pub(crate) fn dump(what: &str, got: &[f32], want: &[f32]) {
    let Some(dir) = std::env::var_os("SLUICE_TEST_DUMP").map(PathBuf::from) else { return };
    let name: String =
        what.chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '_' }).collect();
    for (side, v) in [("gpu", got), ("cpu", want)] {
        let bytes: Vec<u8> = v.iter().take(DUMP_MAX).flat_map(|x| x.to_le_bytes()).collect();
        let path = dir.join(format!("{name}.{side}.f32"));
        if let Err(e) = std::fs::create_dir_all(&dir).and_then(|()| std::fs::write(&path, bytes)) {
            println!("cannot write {}: {e}", path.display());
        }
    }
}

pub(crate) fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

pub(crate) fn uniform(r: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| r.random_range(-scale..scale)).collect()
}

pub(crate) fn round_bf16(v: &[f32]) -> Vec<f32> {
    v.iter().map(|&x| bf16::from_f32(x).to_f32()).collect()
}

pub(crate) fn bits_equal(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// What a buffer of `kind` holds after an upload of `v`.
pub(crate) fn stored(v: &[f32], kind: FloatKind) -> Vec<f32> {
    if kind == Activation { round_bf16(v) } else { v.to_vec() }
}

pub(crate) fn put<B: Backend>(b: &B, v: &[f32], kind: FloatKind) -> B::Floats {
    let mut buf = b.alloc(v.len(), kind).expect("alloc");
    b.upload(b.view_mut(&mut buf, 0..v.len()), v).expect("upload");
    buf
}

pub(crate) fn nan<B: Backend>(b: &B, n: usize, kind: FloatKind) -> B::Floats {
    put(b, &vec![f32::NAN; n], kind)
}

pub(crate) fn get<B: Backend>(b: &B, buf: &B::Floats) -> Vec<f32> {
    let n = b.len(buf);
    let mut host = vec![0.0; n];
    b.download(&mut host, b.view(buf, 0..n)).expect("download");
    host
}

pub(crate) fn ints<B: Backend>(b: &B, v: &[i32]) -> B::Ints {
    let mut i = b.alloc_ints(v.len()).expect("alloc_ints");
    b.upload_ints(&mut i, v).expect("upload_ints");
    i
}

pub(crate) fn all<'a, B: Backend>(b: &B, buf: &'a B::Floats) -> B::View<'a> {
    b.view(buf, 0..b.len(buf))
}

pub(crate) fn all_mut<'a, B: Backend>(b: &B, buf: &'a mut B::Floats) -> B::ViewMut<'a> {
    let n = b.len(buf);
    b.view_mut(buf, 0..n)
}

// The odd sizes every op check uses.
pub(crate) const T: usize = 37;
pub(crate) const H: usize = 96;
pub(crate) const V: usize = 1001;
pub(crate) const I: usize = 80;
/// Four documents, one of them empty.
pub(crate) const CU: [i32; 5] = [0, 10, 10, 25, 37];

pub(crate) fn positions() -> Vec<i32> {
    let mut p = Vec::new();
    for w in CU.windows(2) {
        p.extend(0..w[1] - w[0]);
    }
    p
}

/// `v` at elements `offset..` of a fresh buffer, NaN before them.
pub(crate) fn put_at<B: Backend>(b: &B, v: &[f32], offset: usize, kind: FloatKind) -> B::Floats {
    let mut host = vec![f32::NAN; offset];
    host.extend_from_slice(v);
    put(b, &host, kind)
}

pub(crate) fn from<'a, B: Backend>(b: &B, buf: &'a B::Floats, offset: usize) -> B::View<'a> {
    b.view(buf, offset..b.len(buf))
}

pub(crate) fn from_mut<'a, B: Backend>(
    b: &B,
    buf: &'a mut B::Floats,
    offset: usize,
) -> B::ViewMut<'a> {
    let n = b.len(buf);
    b.view_mut(buf, offset..n)
}

/// Median seconds of `runs` calls of `f` after a warm-up call, each timed between
/// synchronisations of the compute stream.
pub(crate) fn median_seconds(runs: usize, f: &mut dyn FnMut()) -> f64 {
    let g = gpu();
    f();
    g.synchronize().expect("sync");
    let mut times: Vec<f64> = (0..runs)
        .map(|_| {
            let start = std::time::Instant::now();
            f();
            g.synchronize().expect("sync");
            start.elapsed().as_secs_f64()
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[runs / 2]
}
