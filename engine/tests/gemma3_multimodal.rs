//! A Gemma 3 multimodal folder (`Gemma3ForConditionalGeneration`, model_type `gemma3`) trains
//! its text model and writes checkpoints back as the same class.
//!
//! The folder is built here from the golden `gemma3` case (`tests/golden/gemma3/`): its
//! `config.json` nested under `text_config` beneath the wrapper's top-level keys (the special
//! token ids and `tie_word_embeddings` moved up, where the hub's folders keep them), its tensors
//! renamed to each of transformers' two spellings of the text model (`language_model.model.*`,
//! the hub's original files', with the tied `language_model.lm_head.weight` some of them carry;
//! `model.language_model.*`, the module paths since transformers 4.52, sharded), beside a few
//! small vision tower and
//! projector tensors in other dtypes, with awkward bit patterns (NaN payloads, -0, subnormals)
//! that only a byte-for-byte copy keeps.

use std::fs;
use std::path::{Path, PathBuf};

use safetensors::tensor::TensorView;
use serde_json::{Value, json};
use sluice_engine::Error;
use sluice_engine::backend::cpu::Cpu;
use sluice_engine::data::DatasetSource;
use sluice_engine::model::HostParams;
use sluice_engine::spec::ModelSpec;
use sluice_engine::train::{
    Devices, Event, Job, JobSettings, ModelSource, Observer, RunOptions, STATE_DIR, load_model,
    save_checkpoint,
};
use sluice_engine::weights::{Dtype, SaveDtype, TensorSource, TextPrefix};

#[path = "support/golden.rs"]
mod golden;

const CASE: &str = "gemma3";
const SPELLINGS: [TextPrefix; 2] = [TextPrefix::LanguageModel, TextPrefix::ModelLanguageModel];
/// The processor's files of a multimodal folder, which checkpoints carry on.
const PROCESSOR_FILES: [(&str, &str); 2] = [
    ("preprocessor_config.json", r#"{"image_processor_type": "Gemma3ImageProcessor"}"#),
    ("processor_config.json", r#"{"image_seq_length": 4, "processor_class": "Gemma3Processor"}"#),
];

/// A tensor as stored: name, dtype, shape, bytes.
type Stored = (String, Dtype, Vec<usize>, Vec<u8>);

/// The golden case's `config.json`.
fn text_config() -> Value {
    let path = golden::case_dir(CASE).join("config.json");
    serde_json::from_str(&fs::read_to_string(&path).expect("golden config")).expect("JSON")
}

/// The wrapper's `config.json` around the golden text model, as a hub folder has it.
fn wrapper_config() -> Value {
    let mut text = text_config();
    let map = text.as_object_mut().expect("an object");
    let mut top = json!({
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "boi_token_index": 93, "eoi_token_index": 94, "image_token_index": 95,
        "mm_tokens_per_image": 4, "initializer_range": 0.02, "torch_dtype": "bfloat16",
        "transformers_version": "4.50.0.dev0",
        "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 6,
            "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1,
            "image_size": 4, "patch_size": 2, "vision_use_head": false},
    });
    for key in ["bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings"] {
        let value = map.remove(key).expect("the golden config names it");
        top[key] = value;
    }
    map.remove("architectures");
    top["text_config"] = text;
    top
}

/// The golden case's tensors as stored.
fn golden_tensors() -> Vec<Stored> {
    let bytes = fs::read(golden::case_dir(CASE).join("model.safetensors")).expect("golden weights");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("parses");
    let mut out: Vec<Stored> = st
        .tensors()
        .into_iter()
        .map(|(name, t)| (name, t.dtype(), t.shape().to_vec(), t.data().to_vec()))
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// Small vision tower and projector tensors under `prefix`'s spelling: bf16 with NaN payloads,
/// -0 and subnormals, i64 position ids, f32 norms.
fn vision_tensors(prefix: TextPrefix) -> Vec<Stored> {
    let model = match prefix {
        TextPrefix::LanguageModel => "",
        TextPrefix::ModelLanguageModel => "model.",
    };
    let bf16: Vec<u8> = (0..24u16)
        .map(|i| [0x7fc1 + i, 0x8000, 0x0001 + i, 0x3f80 ^ (i << 3)][usize::from(i % 4)])
        .flat_map(u16::to_le_bytes)
        .collect();
    let ids: Vec<u8> = (0i64..4).flat_map(|i| (i - 2).to_le_bytes()).collect();
    let norm: Vec<u8> = [1.5f32, -0.0, f32::MIN_POSITIVE / 4.0, 7.25, 0.1, 1e30]
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect();
    let projector: Vec<u8> = (0..6 * 48u32).flat_map(|i| (i as u16 * 37).to_le_bytes()).collect();
    vec![
        (
            format!("{model}vision_tower.vision_model.embeddings.patch_embedding.weight"),
            Dtype::BF16,
            vec![6, 1, 2, 2],
            bf16,
        ),
        (
            format!("{model}vision_tower.vision_model.embeddings.position_ids"),
            Dtype::I64,
            vec![1, 4],
            ids,
        ),
        (
            format!("{model}multi_modal_projector.mm_soft_emb_norm.weight"),
            Dtype::F32,
            vec![6],
            norm,
        ),
        (
            format!("{model}multi_modal_projector.mm_input_projection_weight"),
            Dtype::BF16,
            vec![6, 48],
            projector,
        ),
    ]
}

fn write_safetensors(path: &Path, tensors: &[Stored]) {
    let views: Vec<(&str, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.as_str(), TensorView::new(*d, s.clone(), b).expect("view")))
        .collect();
    let bytes = safetensors::serialize(views, None).expect("serializes");
    fs::write(path, bytes).expect("writes weights");
}

/// A one-word-a-token tokenizer over the golden vocabulary (97 ids): `<pad>`, the golden
/// config's bos (1) and eos (2), `<unk>`, then `w4` to `w96`.
fn write_tokenizer(dir: &Path) {
    let mut vocab = serde_json::Map::new();
    for (id, token) in ["<pad>", "<bos>", "<eos>", "<unk>"].iter().enumerate() {
        vocab.insert((*token).into(), json!(id));
    }
    for id in 4..97 {
        vocab.insert(format!("w{id}"), json!(id));
    }
    let special = |id: u32, content: &str| {
        json!({"id": id, "content": content, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true})
    };
    let tokenizer = json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [special(0, "<pad>"), special(1, "<bos>"), special(2, "<eos>"),
            special(3, "<unk>")],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    });
    fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).expect("tokenizer");
    let config = json!({"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
        "unk_token": "<unk>"});
    fs::write(dir.join("tokenizer_config.json"), config.to_string()).expect("tokenizer config");
}

/// The golden model as a multimodal folder in `prefix`'s spelling, with a tokenizer and the
/// processor's files: the hub's original spelling as one file holding the tied
/// `language_model.lm_head.weight` too, the module-path one sharded (text, then the rest).
/// Returns the vision tensors written.
fn build(dir: &Path, prefix: TextPrefix) -> Vec<Stored> {
    fs::create_dir_all(dir).expect("folder");
    let config = serde_json::to_string_pretty(&wrapper_config()).expect("JSON");
    fs::write(dir.join("config.json"), config).expect("config");
    write_tokenizer(dir);
    for (name, text) in PROCESSOR_FILES {
        fs::write(dir.join(name), text).expect("processor file");
    }
    let mut text: Vec<Stored> = golden_tensors()
        .into_iter()
        .map(|(name, dtype, shape, bytes)| (hub_name(prefix, &name), dtype, shape, bytes))
        .collect();
    let vision = vision_tensors(prefix);
    match prefix {
        TextPrefix::LanguageModel => {
            let embed = text.iter().find(|t| t.0.ends_with("embed_tokens.weight")).cloned();
            let (_, dtype, shape, bytes) = embed.expect("an embedding");
            text.push(("language_model.lm_head.weight".into(), dtype, shape, bytes));
            text.extend(vision.iter().cloned());
            write_safetensors(&dir.join("model.safetensors"), &text);
        }
        TextPrefix::ModelLanguageModel => {
            let shards = [
                ("model-00001-of-00002.safetensors", &text),
                ("model-00002-of-00002.safetensors", &vision),
            ];
            let mut weight_map = serde_json::Map::new();
            for (file, tensors) in shards {
                write_safetensors(&dir.join(file), tensors);
                for t in tensors.iter() {
                    weight_map.insert(t.0.clone(), json!(file));
                }
            }
            let index = json!({"metadata": {}, "weight_map": weight_map});
            fs::write(dir.join("model.safetensors.index.json"), index.to_string()).expect("index");
        }
    }
    vision
}

/// The name a text model's tensor has in a `Gemma3ForConditionalGeneration` file of the
/// spelling `prefix` stands for, written out here from transformers' conversion mapping (not
/// through the engine's `TextPrefix`, so a wrong mapping there cannot agree with itself).
fn hub_name(prefix: TextPrefix, text: &str) -> String {
    match prefix {
        TextPrefix::LanguageModel => format!("language_model.{text}"),
        TextPrefix::ModelLanguageModel => match text.strip_prefix("model.") {
            Some(rest) => format!("model.language_model.{rest}"),
            None => text.to_string(),
        },
    }
}

fn spelling(prefix: TextPrefix) -> &'static str {
    match prefix {
        TextPrefix::LanguageModel => "language_model.model.*",
        TextPrefix::ModelLanguageModel => "model.language_model.*",
    }
}

/// Asserts two tensors are equal bit for bit, naming the first element that differs.
fn assert_same_bits(what: &str, actual: &[f32], expected: &[f32]) {
    assert_eq!(actual.len(), expected.len(), "{what}: lengths");
    let first = actual.iter().zip(expected).position(|(a, e)| a.to_bits() != e.to_bits());
    if let Some(i) = first {
        panic!("{what}: element {i} is {} where {} was expected", actual[i], expected[i]);
    }
}

#[test]
fn a_multimodal_gemma3_folder_is_the_golden_text_model() {
    let (text_spec, text_params) =
        HostParams::load_dir(&golden::case_dir(CASE)).expect("the golden model loads");
    for prefix in SPELLINGS {
        let tmp = tempfile::tempdir().expect("temp dir");
        let dir = tmp.path().join("gemma3-mm");
        let vision = build(&dir, prefix);
        let label = format!("gemma3 as Gemma3ForConditionalGeneration ({})", spelling(prefix));

        // The spec is the text case's, but for where it was read from.
        let spec = ModelSpec::from_path(&dir).expect("the wrapper's config resolves");
        let wrapper = spec.multimodal.clone().expect("recorded as a multimodal folder");
        assert_eq!(wrapper.architecture, "Gemma3ForConditionalGeneration");
        assert_eq!(wrapper.config, wrapper_config());
        let mut unwrapped = spec.clone();
        unwrapped.raw = text_spec.raw.clone();
        unwrapped.multimodal = None;
        assert_eq!(unwrapped, text_spec, "{label}");

        // The text weights, read under the prefix, are the golden ones bit for bit, and give
        // transformers' logits, loss, gradients and trajectory to the golden tolerances.
        let (loaded_spec, params) = HostParams::load_dir(&dir).expect("the wrapper's weights load");
        assert_eq!(loaded_spec, spec);
        for (u, (got, want)) in params.units.iter().zip(&text_params.units).enumerate() {
            assert_same_bits(&format!("{label}: unit {u} as read"), got, want);
        }
        golden::check_against(CASE, &label, &spec, params);

        // Loaded to train, the vision tower and projector are set apart, not trained.
        let model = load_model(&ModelSource::Dir(dir.clone()), 0).expect("loads to train");
        let keep = model.passthrough.as_ref().expect("a multimodal model keeps its other tensors");
        assert_eq!(keep.prefix(), prefix);
        let mut names: Vec<String> = vision.iter().map(|t| t.0.clone()).collect();
        names.sort();
        assert_eq!(keep.copied(), names, "{label}");
        assert_eq!(model.params.layout.tensors().count(), text_params.layout.tensors().count());

        // A checkpoint of the weights as loaded is the folder again, less the tied head.
        let out = tmp.path().join("as-loaded");
        save_checkpoint(&out, &model, &model.params, SaveDtype::F32).expect("saves");
        let back = TensorSource::open(&out).expect("opens");
        for (name, dtype, _, bytes) in &vision {
            assert_stored(&back, name, *dtype, bytes, &label);
        }
        for (name, _, _, bytes) in golden_tensors() {
            assert_stored(&back, &hub_name(prefix, &name), Dtype::F32, &bytes, &label);
        }
        // Tied: no head is written, neither the stored one nor another.
        assert!(!back.names().iter().any(|n| n.contains("lm_head")), "{label}");
    }
}

/// Asserts a checkpoint stores `name` in `dtype` as exactly `bytes`, naming the first byte
/// that differs.
fn assert_stored(source: &TensorSource, name: &str, dtype: Dtype, bytes: &[u8], label: &str) {
    let got = source.dtype(name).unwrap_or_else(|e| panic!("{label} {name}: {e}"));
    assert_eq!(got, dtype, "{label} {name}: dtype");
    let got = raw_bytes(source.path(), name);
    assert_eq!(got.len(), bytes.len(), "{label} {name}: length");
    if let Some(i) = got.iter().zip(bytes).position(|(a, b)| a != b) {
        panic!("{label} {name}: byte {i} is {:#04x} where {:#04x} was read", got[i], bytes[i]);
    }
}

/// A tensor's bytes out of a checkpoint's files (`origin`: the file, or the index naming its
/// shard), through the safetensors crate.
fn raw_bytes(origin: &Path, name: &str) -> Vec<u8> {
    let file = if origin.extension().is_some_and(|e| e == "json") {
        let index: Value =
            serde_json::from_str(&fs::read_to_string(origin).expect("index")).expect("JSON");
        origin.with_file_name(index["weight_map"][name].as_str().expect("indexed"))
    } else {
        origin.to_path_buf()
    };
    let bytes = fs::read(&file).expect("weights");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("parses");
    st.tensor(name).expect("present").data().to_vec()
}

struct Quiet;

impl Observer for Quiet {
    fn event(&mut self, _: &Event) {}
    fn keep_going(&mut self) -> bool {
        true
    }
}

/// Two steps of `sluice train` on `model` (a few lines of text), saved in f32; the run folder.
fn fine_tune(model: &Path, out: &Path) -> PathBuf {
    let data = out.with_extension("jsonl");
    let lines: Vec<String> = (0..12)
        .map(|r| {
            let words: Vec<String> =
                (0..20).map(|i| format!("w{}", 4 + (r * 7 + i * 5) % 93)).collect();
            json!({"text": words.join(" ")}).to_string()
        })
        .collect();
    fs::write(&data, lines.join("\n") + "\n").expect("dataset");
    let job = Job {
        model: ModelSource::Dir(model.to_path_buf()),
        data: DatasetSource::File(data),
        eval_data: None,
        devices: Devices::Cpu,
        settings: JobSettings {
            seq_len: 32,
            micro_batch: 2,
            grad_accum: 1,
            steps: Some(2),
            lr: Some(1e-2),
            save_dtype: SaveDtype::F32,
            ..JobSettings::default()
        },
    };
    let options = RunOptions::unplanned(job, out.to_path_buf()).expect("a plan-free placement");
    let summary =
        sluice_engine::train::run(&Cpu::new(), &options, false, &mut Quiet).expect("trains");
    assert_eq!(summary.steps, 2);
    out.to_path_buf()
}

#[test]
fn a_fine_tuned_checkpoint_is_the_multimodal_folder_again() {
    let tmp = tempfile::tempdir().expect("temp dir");
    // The same run on the golden text model, from its own folder: what training the text
    // model gives.
    let plain = tmp.path().join("gemma3-text");
    fs::create_dir_all(&plain).expect("folder");
    for file in ["config.json", "model.safetensors"] {
        fs::copy(golden::case_dir(CASE).join(file), plain.join(file)).expect("copies");
    }
    write_tokenizer(&plain);
    let plain_run = fine_tune(&plain, &tmp.path().join("plain-run"));
    let plain_final = TensorSource::open(plain_run.join("final")).expect("opens");

    for prefix in SPELLINGS {
        let label = spelling(prefix);
        let dir = tmp.path().join(format!("mm-{prefix:?}"));
        let vision = build(&dir, prefix);
        let run = fine_tune(&dir, &tmp.path().join(format!("run-{prefix:?}")));
        let checkpoint = run.join("final");

        // The original config (text_config as it was), the class, the processor's files.
        let config: Value = serde_json::from_str(
            &fs::read_to_string(checkpoint.join("config.json")).expect("config"),
        )
        .expect("JSON");
        let mut want = wrapper_config();
        want["torch_dtype"] = json!("float32");
        assert_eq!(config, want, "{label}");
        assert_eq!(config["architectures"], json!(["Gemma3ForConditionalGeneration"]));
        let card = fs::read_to_string(checkpoint.join("README.md")).expect("a model card");
        assert!(card.contains("pipeline_tag: image-text-to-text\n"), "{card}");
        assert!(card.contains("Only the text model was trained"), "{card}");
        for (name, text) in PROCESSOR_FILES {
            assert_eq!(fs::read_to_string(checkpoint.join(name)).expect(name), text, "{label}");
        }

        // Exactly the names the folder was read with, the tied head aside.
        let written = TensorSource::open(&checkpoint).expect("opens");
        let original = TensorSource::open(&dir).expect("opens");
        let mut want: Vec<String> =
            original.names().into_iter().filter(|n| n != "language_model.lm_head.weight").collect();
        want.sort();
        assert_eq!(written.names(), want, "{label}");

        // The vision tower and projector, byte for byte in their own dtypes.
        for (name, dtype, _, bytes) in &vision {
            assert_stored(&written, name, *dtype, bytes, label);
        }

        // The text tensors under their original names are the trained weights: the run's
        // master weights (its training state) and the plain text model's run, bit for bit.
        let state = TensorSource::open(run.join(STATE_DIR)).expect("the training state opens");
        let (_, before) = HostParams::load_dir(&golden::case_dir(CASE)).expect("golden");
        let mut changed = 0;
        for (_, t) in before.layout.tensors() {
            let trained = written.read_f32(&hub_name(prefix, &t.name)).expect("a text tensor");
            assert_eq!(written.dtype(&hub_name(prefix, &t.name)).expect("dtype"), Dtype::F32);
            let master = state.read_f32(&t.name).expect("the master weights");
            assert_same_bits(
                &format!("{label} {}: the trained weights", t.name),
                &trained,
                &master,
            );
            let text_run = plain_final.read_f32(&t.name).expect("the text run's");
            let what = format!("{label} {}: the text model's training", t.name);
            assert_same_bits(&what, &trained, &text_run);
            changed += usize::from(trained != before.get(&t.name).expect("golden tensor"));
        }
        assert!(changed > 0, "{label}: training changed nothing");

        // And the checkpoint trains on: it loads as the same multimodal model.
        let again = load_model(&ModelSource::Dir(checkpoint.clone()), 0).expect("reloads");
        assert_eq!(
            again.spec.multimodal.map(|m| m.architecture),
            Some("Gemma3ForConditionalGeneration")
        );
        assert_eq!(again.passthrough.map(|p| p.prefix()), Some(prefix));
    }
}

#[test]
fn a_multimodal_folder_missing_a_text_tensor_names_it() {
    for prefix in SPELLINGS {
        let tmp = tempfile::tempdir().expect("temp dir");
        let dir = tmp.path().join("gemma3-mm");
        build(&dir, prefix);
        let missing = hub_name(prefix, "model.layers.1.mlp.down_proj.weight");
        // Rewrite the weights without that tensor (and, sharded, the index without its entry).
        let sharded = prefix == TextPrefix::ModelLanguageModel;
        let file = if sharded { "model-00001-of-00002.safetensors" } else { "model.safetensors" };
        let path = dir.join(file);
        let bytes = fs::read(&path).expect("weights");
        let st = safetensors::SafeTensors::deserialize(&bytes).expect("parses");
        let kept: Vec<Stored> = st
            .tensors()
            .into_iter()
            .filter(|(n, _)| *n != missing)
            .map(|(n, t)| (n, t.dtype(), t.shape().to_vec(), t.data().to_vec()))
            .collect();
        write_safetensors(&path, &kept);
        if sharded {
            let index_path = dir.join("model.safetensors.index.json");
            let mut index: Value =
                serde_json::from_str(&fs::read_to_string(&index_path).expect("index"))
                    .expect("JSON");
            index["weight_map"].as_object_mut().expect("a map").remove(&missing);
            fs::write(&index_path, index.to_string()).expect("index");
        }

        for result in [
            HostParams::load_dir(&dir).map(|_| ()),
            load_model(&ModelSource::Dir(dir.clone()), 0).map(|_| ()),
        ] {
            match result {
                Err(Error::Weights { message, .. }) => {
                    assert!(message.contains(&format!("no tensor named '{missing}'")), "{message}");
                    assert!(message.contains("'model.layers.1.mlp.down_proj.weight'"), "{message}");
                }
                other => {
                    panic!("{}: expected a weights error, got {:?}", spelling(prefix), other.err())
                }
            }
        }
    }
}
