//! GGUF import through the models API: a tiny llama written here becomes a listed local model;
//! files the importer refuses get 400 and leave nothing in the models area.

use axum::http::StatusCode;
use serde_json::Value;

use crate::common::{Client, TestApp};
use crate::datasets::{Part, post_parts};

/// A GGUF metadata value of the few types the tiny file needs.
enum Meta {
    U32(u32),
    F32(f32),
    Str(&'static str),
    Strs(Vec<&'static str>),
    I32s(Vec<i32>),
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

/// GGUF v3 with `kv` metadata and f32 `tensors` (GGUF dims, innermost first), data aligned to 32.
fn gguf_bytes(kv: &[(&str, Meta)], tensors: &[(&str, Vec<u64>)]) -> Vec<u8> {
    const U32: u32 = 4;
    const I32: u32 = 5;
    const F32: u32 = 6;
    const STRING: u32 = 8;
    const ARRAY: u32 = 9;
    let mut out = b"GGUF".to_vec();
    out.extend(3u32.to_le_bytes());
    out.extend((tensors.len() as u64).to_le_bytes());
    out.extend((kv.len() as u64).to_le_bytes());
    for (key, value) in kv {
        put_str(&mut out, key);
        match value {
            Meta::U32(x) => {
                out.extend(U32.to_le_bytes());
                out.extend(x.to_le_bytes());
            }
            Meta::F32(x) => {
                out.extend(F32.to_le_bytes());
                out.extend(x.to_le_bytes());
            }
            Meta::Str(s) => {
                out.extend(STRING.to_le_bytes());
                put_str(&mut out, s);
            }
            Meta::Strs(items) => {
                out.extend(ARRAY.to_le_bytes());
                out.extend(STRING.to_le_bytes());
                out.extend((items.len() as u64).to_le_bytes());
                items.iter().for_each(|s| put_str(&mut out, s));
            }
            Meta::I32s(items) => {
                out.extend(ARRAY.to_le_bytes());
                out.extend(I32.to_le_bytes());
                out.extend((items.len() as u64).to_le_bytes());
                items.iter().for_each(|x| out.extend(x.to_le_bytes()));
            }
        }
    }
    let mut offset = 0u64;
    let mut data = Vec::new();
    for (index, (name, dims)) in tensors.iter().enumerate() {
        put_str(&mut out, name);
        out.extend((dims.len() as u32).to_le_bytes());
        dims.iter().for_each(|d| out.extend(d.to_le_bytes()));
        out.extend(0u32.to_le_bytes()); // ggml type F32
        out.extend(offset.to_le_bytes());
        let elements = dims.iter().product::<u64>();
        let mut bytes: Vec<u8> = (0..elements)
            .flat_map(|i| (((i * 7 + index as u64 * 3) % 19) as f32 / 19.0 - 0.5).to_le_bytes())
            .collect();
        bytes.resize(bytes.len().div_ceil(32) * 32, 0);
        offset += bytes.len() as u64;
        data.extend(bytes);
    }
    out.resize(out.len().div_ceil(32) * 32, 0);
    out.extend(data);
    out
}

/// A one-layer llama: hidden 64, two heads of 32 sharing one kv head, vocabulary 8, tied
/// embeddings, a byte-level BPE tokenizer and a chat template.
fn tiny_gguf() -> Vec<u8> {
    let kv = [
        ("general.architecture", Meta::Str("llama")),
        ("general.alignment", Meta::U32(32)),
        ("llama.context_length", Meta::U32(128)),
        ("llama.embedding_length", Meta::U32(64)),
        ("llama.block_count", Meta::U32(1)),
        ("llama.feed_forward_length", Meta::U32(128)),
        ("llama.attention.head_count", Meta::U32(2)),
        ("llama.attention.head_count_kv", Meta::U32(1)),
        ("llama.rope.freq_base", Meta::F32(10000.0)),
        ("llama.attention.layer_norm_rms_epsilon", Meta::F32(1e-5)),
        ("tokenizer.ggml.model", Meta::Str("gpt2")),
        ("tokenizer.ggml.pre", Meta::Str("smollm")),
        (
            "tokenizer.ggml.tokens",
            Meta::Strs(vec!["<|end|>", "a", "b", "c", "Ġ", "ab", "Ġa", "abc"]),
        ),
        ("tokenizer.ggml.token_type", Meta::I32s(vec![3, 1, 1, 1, 1, 1, 1, 1])),
        ("tokenizer.ggml.merges", Meta::Strs(vec!["a b", "Ġ a", "ab c"])),
        ("tokenizer.ggml.eos_token_id", Meta::U32(0)),
        (
            "tokenizer.chat_template",
            Meta::Str("{% for m in messages %}{{ m.content }}{% endfor %}"),
        ),
    ];
    let tensors = [
        ("token_embd.weight", vec![64, 8]),
        ("blk.0.attn_norm.weight", vec![64]),
        ("blk.0.attn_q.weight", vec![64, 64]),
        ("blk.0.attn_k.weight", vec![64, 32]),
        ("blk.0.attn_v.weight", vec![64, 32]),
        ("blk.0.attn_output.weight", vec![64, 64]),
        ("blk.0.ffn_norm.weight", vec![64]),
        ("blk.0.ffn_gate.weight", vec![64, 128]),
        ("blk.0.ffn_up.weight", vec![64, 128]),
        ("blk.0.ffn_down.weight", vec![128, 64]),
        ("output_norm.weight", vec![64]),
    ];
    gguf_bytes(&kv, &tensors)
}

async fn import(client: &Client, file_name: &str, bytes: &[u8], name: Option<&str>) -> Value {
    match client.upload_to("/api/models/import", file_name, bytes, name).await {
        Ok(reply) => {
            serde_json::json!({"status": reply.status.as_u16(), "body": reply.json().ok()})
        }
        Err(err) => serde_json::json!({"status": 0, "body": err.to_string()}),
    }
}

/// The names in the models area, hidden ones included, sorted.
fn models_area(app: &TestApp) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(app.state.models_dir())
        .map(|entries| {
            entries.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

#[tokio::test]
async fn a_gguf_upload_becomes_a_local_model() -> anyhow::Result<()> {
    let app = TestApp::new().await?;
    let admin = app.admin().await?;
    let user = app.user(&admin, "alice").await?;

    let reply = import(&user, "Tiny Llama.gguf", &tiny_gguf(), None).await;
    assert_eq!(reply["status"], 201, "{reply}");
    let model = &reply["body"];
    assert_eq!(model["id"], "local:Tiny-Llama", "{model}");
    assert_eq!(model["kind"], "local");
    assert_eq!(model["family"], "llama");
    assert!(model["params"].as_u64().is_some_and(|p| p > 0), "{model}");

    let listed = admin.get("/api/models").await?.json()?;
    assert!(
        listed.as_array().is_some_and(|l| l.iter().any(|m| m["id"] == "local:Tiny-Llama")),
        "{listed}"
    );
    assert_eq!(models_area(&app), ["Tiny-Llama"], "the upload and staging folder are gone");
    let folder = app.state.models_dir().join("Tiny-Llama");
    for file in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        assert!(folder.join(file).is_file(), "{file}");
    }

    // A job can pick it: the planner resolves the id against the folder.
    let plan = admin
        .post(
            "/api/plan",
            serde_json::json!({"model": "local:Tiny-Llama", "gpu": "cpu", "seq_len": 32}),
        )
        .await?;
    assert_eq!(plan.status, StatusCode::OK, "{}", plan.text());

    let again = import(&user, "x.gguf", &tiny_gguf(), Some("Tiny-Llama")).await;
    assert_eq!(again["status"], 409, "{again}");
    assert_eq!(models_area(&app), ["Tiny-Llama"]);
    Ok(())
}

#[tokio::test]
async fn refused_files_get_400_and_leave_nothing() -> anyhow::Result<()> {
    let app = TestApp::new().await?;
    let admin = app.admin().await?;
    let good = tiny_gguf();
    let cases: [(&str, Vec<u8>); 3] = [
        ("garbage", b"this is not a GGUF file at all, just some text\n".repeat(50)),
        ("truncated", good[..good.len() / 2].to_vec()),
        ("gguf-header-only", good[..24].to_vec()),
    ];
    for (name, bytes) in cases {
        let reply = import(&admin, "model.gguf", &bytes, Some(name)).await;
        assert_eq!(reply["status"], 400, "{name}: {reply}");
        let error = reply["body"]["error"].as_str().unwrap_or_default();
        assert!(error.starts_with("cannot import model.gguf"), "{name}: {error}");
        assert!(!error.contains(".upload-"), "no temporary path in {error}");
        if name == "garbage" {
            assert!(error.contains("not a GGUF file"), "{error}");
        }
        if name == "truncated" {
            assert!(error.contains("truncated"), "{error}");
        }
        assert!(models_area(&app).is_empty(), "{name}: {:?}", models_area(&app));
    }

    for bad_name in ["../escape", ".hidden", "a b"] {
        let reply = import(&admin, "model.gguf", &good, Some(bad_name)).await;
        assert_eq!(reply["status"], 400, "{bad_name}: {reply}");
    }
    let empty = import(&admin, "model.gguf", b"", Some("empty")).await;
    assert_eq!(empty["status"], 400, "{empty}");
    assert!(models_area(&app).is_empty(), "{:?}", models_area(&app));
    Ok(())
}

#[tokio::test]
async fn importing_needs_a_session_and_the_csrf_token() -> anyhow::Result<()> {
    let app = TestApp::new().await?;
    let admin = app.admin().await?;
    let mut no_csrf = app.client();
    no_csrf.cookie = admin.cookie.clone();
    let reply = import(&no_csrf, "model.gguf", &tiny_gguf(), Some("m")).await;
    assert_eq!(reply["status"], 403, "{reply}");

    let mut anonymous = app.client();
    anonymous.session().await?;
    let reply = import(&anonymous, "model.gguf", &tiny_gguf(), Some("m")).await;
    assert_eq!(reply["status"], 401, "{reply}");
    assert!(models_area(&app).is_empty());
    Ok(())
}

#[tokio::test]
async fn uploads_over_the_limit_get_413() -> anyhow::Result<()> {
    let app = TestApp::with_config(|c| c.max_upload_bytes = 1000).await?;
    let admin = app.admin().await?;
    let reply = import(&admin, "model.gguf", &tiny_gguf(), Some("big")).await;
    assert_eq!(reply["status"], 413, "{reply}");
    assert!(models_area(&app).is_empty());
    Ok(())
}

#[tokio::test]
async fn a_name_over_its_limit_is_refused_and_leaves_nothing() -> anyhow::Result<()> {
    let app = TestApp::new().await?;
    let admin = app.admin().await?;
    let gguf = tiny_gguf();
    let huge = vec![b'm'; 2 << 20];
    // After the file, so the upload has been streamed to a temporary file that must go again.
    let parts = [Part("file", Some("model.gguf"), &gguf), Part("name", None, &huge)];
    let reply = post_parts(&admin, "/api/models/import", &parts).await?;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{}", reply.text());
    assert_eq!(reply.error(), "the multipart field \"name\" is longer than 1024 bytes");
    // The error names the field, not its contents.
    assert!(reply.body.len() < 200, "{} bytes", reply.body.len());
    assert!(models_area(&app).is_empty(), "{:?}", models_area(&app));

    let parts = [Part("file", Some("model.gguf"), &gguf), Part("note", None, &huge)];
    let reply = post_parts(&admin, "/api/models/import", &parts).await?;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{}", reply.text());
    assert!(reply.error().contains("\"note\""), "{}", reply.text());
    assert!(models_area(&app).is_empty(), "{:?}", models_area(&app));
    Ok(())
}

/// A Hugging Face folder of every family the engine trains, dropped into the models area (the
/// golden fixtures' tiny models: config.json as transformers writes it and its weights), is
/// listed with its family and parameter count and planned for a job.
#[tokio::test]
async fn a_local_folder_of_every_family_is_listed_and_planned() -> anyhow::Result<()> {
    let app = TestApp::new().await?;
    let admin = app.admin().await?;
    let golden = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/golden");
    let cases = [
        ("llama", "llama"),
        ("qwen2", "qwen2"),
        ("qwen3", "qwen3"),
        ("mistral", "mistral"),
        ("phi3", "phi3"),
        ("gemma2", "gemma2"),
        ("gemma3", "gemma3_text"),
        ("mixtral", "mixtral"),
        ("qwen3_moe", "qwen3_moe"),
        ("qwen2_moe", "qwen2_moe"),
        ("gpt_oss", "gpt_oss"),
    ];
    for (case, _) in cases {
        let dir = app.state.models_dir().join(case);
        std::fs::create_dir_all(&dir)?;
        for file in ["config.json", "model.safetensors"] {
            std::fs::copy(golden.join(case).join(file), dir.join(file))?;
        }
    }
    let listed = admin.get("/api/models").await?.json()?;
    let listed = listed.as_array().cloned().unwrap_or_default();
    for (case, family) in cases {
        let id = format!("local:{case}");
        let model = listed.iter().find(|m| m["id"] == id.as_str());
        let model = model.unwrap_or_else(|| panic!("{id} is not listed"));
        assert_eq!(model["family"], family, "{model}");
        assert!(model["params"].as_u64().is_some_and(|p| p > 0), "{model}");
        let plan = admin
            .post("/api/plan", serde_json::json!({"model": id, "gpu": "cpu", "seq_len": 32}))
            .await?;
        assert_eq!(plan.status, StatusCode::OK, "{case}: {}", plan.text());
    }
    // The presets of the mixtures of experts are listed too, every expert counted.
    for (preset, params) in [("mixtral-8x7b", 46_702_792_704u64), ("gpt-oss-120b", 116_829_156_672)]
    {
        let id = format!("preset:{preset}");
        let model = listed.iter().find(|m| m["id"] == id.as_str());
        assert_eq!(model.map(|m| m["params"].clone()), Some(params.into()), "{id}");
    }
    Ok(())
}

/// A Gemma 3 multimodal folder (`Gemma3ForConditionalGeneration`: the golden gemma3 case's
/// config under `text_config`, its tensors under `language_model.model.*`, a vision tensor
/// beside them) is listed as `gemma3` with a note that only its text model is trained, counted
/// at its text model's size, and planned; a multimodal family Sluice does not train is refused
/// by name.
#[tokio::test]
async fn a_gemma3_multimodal_folder_is_listed_with_its_note_and_planned() -> anyhow::Result<()> {
    use sluice_engine::weights::{SaveDtype, TensorRef, TensorSource, write_safetensors};

    let app = TestApp::new().await?;
    let admin = app.admin().await?;
    let golden = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/golden/gemma3");
    let text: Value = serde_json::from_str(&std::fs::read_to_string(golden.join("config.json"))?)?;
    let config = serde_json::json!({
        "model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
        "mm_tokens_per_image": 4, "image_token_index": 95, "text_config": text,
        "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 4},
    });
    let dir = app.state.models_dir().join("gemma3-mm");
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join("config.json"), config.to_string())?;
    let source = TensorSource::open(&golden)?;
    let mut tensors = Vec::new();
    for name in source.names() {
        tensors.push((
            format!("language_model.{name}"),
            source.shape(&name)?,
            source.read_f32(&name)?,
        ));
    }
    let vision = vec![0.5f32; 8];
    tensors.push(("vision_tower.vision_model.post_layernorm.weight".into(), vec![8], vision));
    let refs: Vec<TensorRef<'_>> = tensors
        .iter()
        .map(|(n, s, v)| TensorRef { name: n, shape: s.clone(), data: v[..].into() })
        .collect();
    write_safetensors(&dir, &refs, SaveDtype::F32, usize::MAX)?;
    let llava = app.state.models_dir().join("llava");
    std::fs::create_dir_all(&llava)?;
    let llava_config = serde_json::json!({"model_type": "llava",
        "architectures": ["LlavaForConditionalGeneration"], "text_config": {"model_type": "llama"}});
    std::fs::write(llava.join("config.json"), llava_config.to_string())?;

    let listed = admin.get("/api/models").await?.json()?;
    let listed = listed.as_array().cloned().unwrap_or_default();
    let model = listed.iter().find(|m| m["id"] == "local:gemma3-mm");
    let model = model.unwrap_or_else(|| panic!("the multimodal folder is not listed: {listed:?}"));
    assert_eq!(model["family"], "gemma3", "{model}");
    let note = model["note"].as_str().unwrap_or_default();
    assert!(
        note.contains("Gemma3ForConditionalGeneration: only the text model is trained"),
        "{model}"
    );
    let text_only = listed.iter().find(|m| m["family"] == "llama" && m["kind"] == "preset");
    assert!(text_only.is_some_and(|m| m["note"].is_null()), "a text model has no note");
    let spec = sluice_engine::spec::ModelSpec::from_path(&golden)?;
    assert_eq!(model["params"].as_u64(), Some(spec.total_params() as u64), "the text model's size");
    let plan = admin
        .post(
            "/api/plan",
            serde_json::json!({"model": "local:gemma3-mm", "gpu": "cpu", "seq_len": 32}),
        )
        .await?;
    assert_eq!(plan.status, StatusCode::OK, "{}", plan.text());

    assert!(!listed.iter().any(|m| m["id"] == "local:llava"), "an unsupported family is listed");
    let plan = admin
        .post("/api/plan", serde_json::json!({"model": "local:llava", "gpu": "cpu", "seq_len": 32}))
        .await?;
    assert_eq!(plan.status, StatusCode::BAD_REQUEST, "{}", plan.text());
    assert!(
        plan.error().contains(
            "multimodal model_type \"llava\" (LlavaForConditionalGeneration) is not supported"
        ),
        "{}",
        plan.text()
    );
    Ok(())
}
