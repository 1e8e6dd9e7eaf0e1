//! Checkpoint folders written atomically: complete, replacing, cleared after a crash, untouched
//! by a failed save.

use std::fs;
use std::path::Path;

use super::*;
use crate::weights::{CONFIG_FILE, HfFolder, INDEX_FILE, SaveDtype, TensorSource, save_hf_folder};

fn checkpoint<'a>(tensors: Vec<TensorRef<'a>>, extra: &[(&str, &str)]) -> HfFolder<'a> {
    HfFolder {
        tensors,
        dtype: SaveDtype::F32,
        max_shard_bytes: 64,
        config: serde_json::json!({ "model_type": "llama", "hidden_size": 4 }),
        extra_files: extra.iter().map(|(n, b)| (n.to_string(), b.as_bytes().to_vec())).collect(),
    }
}

fn read(dir: &Path, name: &str) -> crate::Result<Vec<f32>> {
    TensorSource::open(dir)?.read_f32(name)
}

#[test]
fn saves_a_complete_folder_creating_the_parent() -> TestResult {
    let root = tempdir()?;
    let dest = root.path().join("runs").join("step-10");
    let (a, b) = (values(16, 0), values(16, 1));
    let files = checkpoint(
        vec![tensor("a", &[4, 4], &a), tensor("b", &[16], &b)],
        &[("tokenizer.json", r#"{"model":{}}"#), ("chat_template.jinja", "{{ messages }}")],
    );
    save_hf_folder(&dest, &files)?;

    assert_eq!(listing(&root.path().join("runs"))?, ["step-10"], "no .partial or .old left");
    let mut want = vec![
        CONFIG_FILE.to_string(),
        INDEX_FILE.to_string(),
        "chat_template.jinja".into(),
        "model-00001-of-00002.safetensors".into(),
        "model-00002-of-00002.safetensors".into(),
        "tokenizer.json".into(),
    ];
    want.sort();
    assert_eq!(listing(&dest)?, want);
    let config = fs::read_to_string(dest.join(CONFIG_FILE))?;
    assert!(config.ends_with("}\n") && config.contains("\n  \"hidden_size\": 4"), "{config}");
    assert_eq!(serde_json::from_str::<serde_json::Value>(&config)?, files.config);
    assert_eq!(fs::read_to_string(dest.join("chat_template.jinja"))?, "{{ messages }}");
    assert_eq!(bits(&read(&dest, "a")?), bits(&a));
    assert_eq!(bits(&read(&dest, "b")?), bits(&b));
    Ok(())
}

#[test]
fn replaces_an_existing_folder_entirely() -> TestResult {
    let root = tempdir()?;
    let dest = root.path().join("ckpt");
    let (old, new) = (values(4, 0), values(4, 1));
    save_hf_folder(&dest, &checkpoint(vec![tensor("w", &[4], &old)], &[("stale.txt", "x")]))?;
    assert_eq!(bits(&read(&dest, "w")?), bits(&old));

    save_hf_folder(&dest, &checkpoint(vec![tensor("w", &[4], &new)], &[]))?;
    assert_eq!(bits(&read(&dest, "w")?), bits(&new));
    assert!(!dest.join("stale.txt").exists(), "files of the old checkpoint are gone");
    assert_eq!(listing(root.path())?, ["ckpt"], "no .partial or .old left");
    Ok(())
}

#[test]
fn leftover_partial_from_a_crash_is_cleared() -> TestResult {
    let root = tempdir()?;
    let dest = root.path().join("ckpt");
    let partial = root.path().join(".ckpt.partial");
    fs::create_dir(&partial)?;
    fs::write(partial.join("model-00001-of-00009.safetensors"), "half a shard")?;
    let w = values(4, 0);
    save_hf_folder(&dest, &checkpoint(vec![tensor("w", &[4], &w)], &[]))?;
    assert_eq!(listing(root.path())?, ["ckpt"]);
    assert!(!dest.join("model-00001-of-00009.safetensors").exists());
    Ok(())
}

#[test]
fn a_failed_save_leaves_the_existing_checkpoint_untouched() -> TestResult {
    let root = tempdir()?;
    let dest = root.path().join("ckpt");
    let (old, bad) = (values(4, 0), values(3, 1));
    save_hf_folder(&dest, &checkpoint(vec![tensor("w", &[4], &old)], &[("keep.txt", "k")]))?;

    // Fails after the partial folder exists (the writer rejects the shape).
    let message =
        invalid_error(save_hf_folder(&dest, &checkpoint(vec![tensor("w", &[4], &bad)], &[])));
    assert!(message.contains("'w'"), "{message}");
    assert_eq!(listing(root.path())?, ["ckpt"], "partial folder removed");
    assert_eq!(bits(&read(&dest, "w")?), bits(&old));
    assert!(dest.join("keep.txt").exists());
    Ok(())
}

#[test]
fn extra_files_must_be_plain_and_not_clash() -> TestResult {
    let root = tempdir()?;
    let dest = root.path().join("ckpt");
    let w = values(4, 0);
    for (name, why) in [
        ("../escape.json", "plain file name"),
        ("", "plain file name"),
        (CONFIG_FILE, "overwrite"),
        ("model-00001-of-00002.safetensors", "overwrite"),
        (INDEX_FILE, "overwrite"),
    ] {
        let message = invalid_error(save_hf_folder(
            &dest,
            &checkpoint(vec![tensor("w", &[4], &w)], &[(name, "x")]),
        ));
        assert!(message.contains(name) && message.contains(why), "{name}: {message}");
    }
    let twice = checkpoint(vec![tensor("w", &[4], &w)], &[("a.json", "1"), ("a.json", "2")]);
    let message = invalid_error(save_hf_folder(&dest, &twice));
    assert!(message.contains("twice"), "{message}");
    assert_eq!(listing(root.path())?, Vec::<String>::new(), "nothing written");
    Ok(())
}

#[test]
fn a_quantization_config_is_not_written_beside_float_tensors() -> TestResult {
    // A model read from gpt-oss's MXFP4 release is saved as floats; its inherited
    // `quantization_config` would make transformers look for packed tensors.
    let root = tempdir()?;
    let a = values(4, 0);
    let mut files = checkpoint(vec![tensor("a", &[4], &a)], &[]);
    files.config["quantization_config"] = serde_json::json!({ "quant_method": "mxfp4" });
    save_hf_folder(root.path().join("out"), &files)?;
    let written: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(root.path().join("out").join(CONFIG_FILE))?)?;
    assert_eq!(written, serde_json::json!({ "model_type": "llama", "hidden_size": 4 }));
    Ok(())
}
