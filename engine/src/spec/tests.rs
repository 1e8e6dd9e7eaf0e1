//! `config.json` to `ModelSpec`: family differences as data, RoPE scaling in both config
//! generations, preset parameter counts, and bad configs that say what is wrong.

use std::path::Path;

use serde_json::{Value, json};

use super::*;

fn check(raw: Value) -> Result<ModelSpec> {
    ModelSpec::from_hf(raw, Path::new("test/config.json"))
}

fn base(model_type: &str) -> Value {
    json!({
        "model_type": model_type, "vocab_size": 97, "hidden_size": 48, "intermediate_size": 80,
        "num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 2,
    })
}

fn message(r: Result<ModelSpec>) -> String {
    match r {
        Ok(s) => panic!("expected an error, got {s:?}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn families_differ_only_as_data() {
    let llama = check(base("llama")).unwrap();
    assert_eq!((llama.qkv_bias, llama.qk_norm, llama.head_dim), (false, false, 8));
    assert_eq!(llama.windows, vec![None, None]);
    let qwen2 = check(base("qwen2")).unwrap();
    assert!(qwen2.qkv_bias && !qwen2.o_bias && !qwen2.qk_norm);
    let mut q3 = base("qwen3");
    q3["head_dim"] = json!(12);
    let qwen3 = check(q3).unwrap();
    assert!(qwen3.qk_norm && !qwen3.qkv_bias);
    assert_eq!(qwen3.head_dim, 12);
    assert_eq!(qwen3.qkv_width(), (6 + 4) * 12);
    let mut m = base("mistral");
    m["sliding_window"] = json!(5);
    assert_eq!(check(m).unwrap().windows, vec![Some(5), Some(5)]);
    let mut l = base("llama");
    l["attention_bias"] = json!(true);
    let l = check(l).unwrap();
    assert!(l.qkv_bias && l.o_bias);
}

#[test]
fn qwen_sliding_window_applies_from_max_window_layers() {
    let mut q = base("qwen2");
    q["use_sliding_window"] = json!(true);
    q["sliding_window"] = json!(7);
    q["max_window_layers"] = json!(1);
    assert_eq!(check(q.clone()).unwrap().windows, vec![None, Some(7)]);
    q["layer_types"] = json!(["sliding_attention", "full_attention"]);
    assert_eq!(check(q).unwrap().windows, vec![Some(7), None]);
}

#[test]
fn rope_scaling_both_config_generations() {
    let mut old = base("llama");
    old["rope_theta"] = json!(500000.0);
    old["rope_scaling"] = json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192});
    let mut new = base("llama");
    new["rope_parameters"] = json!({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
        "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192});
    let (a, b) = (check(old).unwrap(), check(new).unwrap());
    assert_eq!(a.rope_theta, 500000.0);
    assert_eq!(a.rope_scaling, b.rope_scaling);
    assert_eq!(a.inv_freq(), b.inv_freq());
    let mut lin = base("llama");
    lin["rope_scaling"] = json!({"type": "linear", "factor": 2.0});
    let lin = check(lin).unwrap();
    let plain = check(base("llama")).unwrap();
    for (s, p) in lin.inv_freq().iter().zip(plain.inv_freq()) {
        assert_eq!(*s, p / 2.0);
    }
}

#[test]
fn llama3_rope_rescales_only_low_frequencies() {
    let spec = preset("llama3-8b").unwrap();
    let mut unscaled = spec.clone();
    unscaled.rope_scaling = RopeScaling::None;
    let (scaled, plain) = (spec.inv_freq(), unscaled.inv_freq());
    assert_eq!(scaled.len(), 64);
    // The highest frequencies (short wavelengths) are untouched, the lowest divided by 8.
    assert_eq!(scaled[0], plain[0]);
    assert!((scaled[63] - plain[63] / 8.0).abs() <= plain[63] * 1e-6);
    // In between they are interpolated, so strictly between the two.
    let mid = (0..64).find(|&i| scaled[i] != plain[i] && scaled[i] != plain[i] / 8.0);
    assert!(mid.is_some(), "no interpolated frequency");
}

#[test]
fn preset_parameter_counts_match_the_real_models() {
    // Published parameter counts of the real checkpoints.
    assert_eq!(preset("qwen2.5-0.5b").unwrap().total_params(), 494_032_768);
    assert_eq!(preset("qwen2.5-7b").unwrap().total_params(), 7_615_616_512);
    assert_eq!(preset("llama3-8b").unwrap().total_params(), 8_030_261_248);
    assert_eq!(preset("qwen3-8b").unwrap().total_params(), 8_190_735_360);
    // Mixtures of experts: every expert counted.
    assert_eq!(preset("mixtral-8x7b").unwrap().total_params(), 46_702_792_704);
    assert_eq!(preset("qwen3-30b-a3b").unwrap().total_params(), 30_532_122_624);
    assert_eq!(preset("gpt-oss-20b").unwrap().total_params(), 20_914_757_184);
    assert_eq!(preset("gpt-oss-120b").unwrap().total_params(), 116_829_156_672);
    for (name, _) in PRESETS {
        preset(name).unwrap();
    }
}

#[test]
fn bad_configs_say_what_is_wrong() {
    assert!(message(check(base("gpt2"))).contains("unsupported model_type \"gpt2\""));
    let mut heads = base("llama");
    heads["num_key_value_heads"] = json!(4);
    assert!(message(check(heads)).contains("not a multiple of num_key_value_heads"));
    let mut missing = base("qwen2");
    missing.as_object_mut().unwrap().remove("hidden_size");
    assert!(message(check(missing)).contains("hidden_size is missing"));
    let mut dynamic = base("llama");
    dynamic["rope_scaling"] = json!({"rope_type": "dynamic", "factor": 4.0});
    assert!(message(check(dynamic)).contains("\"dynamic\" is not supported"));
    let mut yarn = base("llama");
    yarn["rope_scaling"] = json!({"rope_type": "yarn", "factor": 4.0});
    assert!(message(check(yarn)).contains("original_max_position_embeddings"));
    let mut top = base("mixtral");
    top["num_local_experts"] = json!(4);
    top["num_experts_per_tok"] = json!(5);
    assert!(message(check(top)).contains("num_experts_per_tok must be in 1..=4"));
    let mut shared = base("qwen2_moe");
    shared["shared_expert_intermediate_size"] = json!(64);
    shared["num_experts"] = json!(4);
    shared["num_experts_per_tok"] = json!(2);
    let spec = check(shared).expect("qwen2_moe with a shared expert");
    assert_eq!(spec.moe.as_ref().and_then(|m| m.shared_inter), Some(64));
    assert!(spec.qkv_bias && !spec.o_bias);
    let mut odd = base("llama");
    odd["head_dim"] = json!(7);
    assert!(message(check(odd)).contains("even"));
    let mut wrong_type = base("llama");
    wrong_type["hidden_size"] = json!("big");
    assert!(message(check(wrong_type)).contains("unexpected field type"));
    assert!(message(check(json!({"hidden_size": 4}))).contains("no model_type"));
    assert!(preset("nope").unwrap_err().to_string().contains("unknown preset"));
}

#[test]
fn files_missing_or_garbled() {
    let dir = tempfile::tempdir().unwrap();
    assert!(ModelSpec::from_path(dir.path()).unwrap_err().to_string().contains("config.json"));
    std::fs::write(dir.path().join("config.json"), "{\"model_type\": \"llama\",").unwrap();
    let e = ModelSpec::from_path(dir.path()).unwrap_err().to_string();
    assert!(e.contains("not valid JSON"), "{e}");
}

#[test]
fn phi3_longrope_partial_rotary_in_both_config_generations() {
    // transformers 4 (Phi-3.5, Phi-4-mini): "su"/"longrope" in rope_scaling, the rotary share
    // and pretrained context at the top level; transformers 5: all inside rope_parameters.
    let mut old = base("phi3");
    old["max_position_embeddings"] = json!(64);
    old["original_max_position_embeddings"] = json!(8);
    old["partial_rotary_factor"] = json!(0.75);
    old["rope_scaling"] = json!({"type": "su", "short_factor": [1.0, 1.25, 1.5],
        "long_factor": [1.0, 3.0, 9.0]});
    let mut new = base("phi3");
    new["max_position_embeddings"] = json!(64);
    new["rope_parameters"] = json!({"rope_type": "longrope", "rope_theta": 10000.0,
        "partial_rotary_factor": 0.75, "original_max_position_embeddings": 8,
        "short_factor": [1.0, 1.25, 1.5], "long_factor": [1.0, 3.0, 9.0]});
    let (a, b) = (check(old).unwrap(), check(new).unwrap());
    assert_eq!(a.rope_scaling, b.rope_scaling);
    assert!(a.fused_checkpoint && !a.qkv_bias && !a.o_bias);
    assert_eq!((a.head_dim, a.rotary_dim), (8, 6));
    // 1 / (factor_i 10000^(2i/6)), and sqrt(1 + ln 8 / ln 8) for a context 8x the original.
    let short = a.inv_freq();
    assert_eq!(short.len(), 3);
    assert_eq!(short[0], 1.0);
    assert!((short[2] - 1.0 / (1.5 * 10000f32.powf(4.0 / 6.0))).abs() <= 1e-9);
    let (above, long) = a.long_inv_freq().unwrap();
    assert_eq!(above, 8);
    assert!((long[2] - 1.0 / (9.0 * 10000f32.powf(4.0 / 6.0))).abs() <= 1e-9);
    assert!((a.rope_scale() - 2f32.sqrt()).abs() <= 1e-6);
    // Names follow the checkpoint: fused projections.
    let layout = crate::model::ModelLayout::new(&a);
    let names: Vec<&str> = layout.units[1].tensors.iter().map(|t| t.name.as_str()).collect();
    assert!(names.contains(&"model.layers.0.self_attn.qkv_proj.weight"), "{names:?}");
    assert!(names.contains(&"model.layers.0.mlp.gate_up_proj.weight"), "{names:?}");

    let mut few = base("phi3");
    few["rope_parameters"] = json!({"rope_type": "longrope", "original_max_position_embeddings": 8,
        "short_factor": [1.0], "long_factor": [1.0, 3.0, 9.0, 27.0]});
    assert!(message(check(few)).contains("needs 4 short and long factors"));
    let mut partial = base("llama");
    partial["partial_rotary_factor"] = json!(0.1);
    assert!(message(check(partial)).contains("rotary dimensions"));
}

#[test]
fn gemma3_as_data_in_both_config_generations() {
    // Gemma3TextConfig's head_dim defaults to 256, not hidden / heads: these name theirs.
    let mut gemma3 = base("gemma3_text");
    assert_eq!(check(gemma3.clone()).unwrap().head_dim, 256);
    gemma3["head_dim"] = json!(8);
    // transformers 5: layer types and a RoPE per layer type.
    let mut new = gemma3.clone();
    new["num_hidden_layers"] = json!(3);
    new["sliding_window"] = json!(5);
    new["query_pre_attn_scalar"] = json!(4);
    new["layer_types"] = json!(["sliding_attention", "sliding_attention", "full_attention"]);
    new["rope_parameters"] = json!({
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0}});
    // transformers 4: a sliding pattern, the local base apart, the global scaling.
    let mut old = gemma3.clone();
    old["num_hidden_layers"] = json!(3);
    old["sliding_window"] = json!(5);
    old["query_pre_attn_scalar"] = json!(4);
    old["sliding_window_pattern"] = json!(3);
    old["rope_theta"] = json!(1000000.0);
    old["rope_local_base_freq"] = json!(10000.0);
    old["rope_scaling"] = json!({"rope_type": "linear", "factor": 8.0});
    let (a, b) = (check(new).unwrap(), check(old).unwrap());
    for s in [&a, &b] {
        assert_eq!(s.windows, vec![Some(5), Some(5), None]);
        assert_eq!(s.rope_theta, 1e6);
        assert_eq!(s.rope_scaling, RopeScaling::Linear { factor: 8.0 });
        assert_eq!(s.local_rope, Some(LocalRope { theta: 1e4, scaling: RopeScaling::None }));
        assert!(s.tie_embeddings && s.qk_norm && s.sandwich_norms);
        assert_eq!((s.norm_offset, s.scale_dim, s.glu_act), (1.0, Some(4), GluAct::GeluTanh));
        assert_eq!(s.embed_scale, 48f32.sqrt());
    }
    // The local table is the plain 1e4 one, the global one 1e6 divided by 8.
    let (local, global) = (a.local_inv_freq().unwrap(), a.inv_freq());
    assert_eq!(local[1], 1.0 / 10000f32.powf(2.0 / 8.0));
    assert_eq!(global[1], 1.0 / 1000000f32.powf(2.0 / 8.0) / 8.0);
    // Names follow the checkpoint: four norms per layer, Gemma's roles.
    let layout = crate::model::ModelLayout::new(&a);
    let names: Vec<&str> = layout.units[1].tensors.iter().map(|t| t.name.as_str()).collect();
    for norm in ["input", "post_attention", "pre_feedforward", "post_feedforward"] {
        let name = format!("model.layers.0.{norm}_layernorm.weight");
        assert!(names.contains(&name.as_str()), "{name} in {names:?}");
    }
    // Random init draws Gemma's norm weights at 0 (a scale of 1 + 0).
    let p = crate::model::HostParams::random(&a, 1);
    let (u, t) = layout
        .tensors()
        .find(|(_, t)| t.name.ends_with("post_attention_layernorm.weight"))
        .unwrap();
    assert!(p.units[u][t.range.clone()].iter().all(|&x| x == 0.0));

    let mut capped = base("gemma3_text");
    capped["sliding_window"] = json!(5);
    capped["final_logit_softcapping"] = json!(30.0);
    assert_eq!(check(capped).unwrap().final_softcap, Some(30.0));
    let mut act = base("llama");
    act["hidden_act"] = json!("relu");
    assert!(message(check(act)).contains("\"relu\" is not supported"));
}

#[test]
fn gemma2_caps_and_alternation_by_default() {
    let mut g = base("gemma2");
    g["num_hidden_layers"] = json!(3);
    g["sliding_window"] = json!(5);
    let s = check(g.clone()).unwrap();
    // Gemma2Config's defaults: caps 50 and 30, scores over sqrt(256), even layers slide.
    assert_eq!((s.attn_softcap, s.final_softcap, s.scale_dim), (Some(50.0), Some(30.0), Some(256)));
    assert_eq!(s.windows, vec![Some(5), None, Some(5)]);
    assert!(s.sandwich_norms && !s.qk_norm && s.tie_embeddings && s.local_rope.is_none());
    // null turns a cap off; a cap on another family, or a bad one, is refused.
    g["final_logit_softcapping"] = Value::Null;
    assert_eq!(check(g.clone()).unwrap().final_softcap, None);
    g["attn_logit_softcapping"] = json!(-1.0);
    assert!(message(check(g)).contains("attn_logit_softcapping must be a positive number"));
    let mut llama = base("llama");
    llama["final_logit_softcapping"] = json!(30.0);
    assert!(message(check(llama)).contains("final_logit_softcapping is not supported for llama"));
    assert_eq!(preset("gemma-2-9b").unwrap().windows[..2], [Some(4096), None]);
}

/// A Gemma 3 multimodal folder's `config.json` in the shape the hub's gemma-3 4B/12B/27B folders
/// have it (transformers 4.50): `text_config` names the text model's sizes, window and global
/// RoPE scaling, and `Gemma3TextConfig`'s defaults supply the rest; the vision tower is cut short.
fn gemma3_12b_folder() -> Value {
    json!({
        "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999,
        "eoi_token_index": 256000, "eos_token_id": [1, 106], "image_token_index": 262144,
        "initializer_range": 0.02, "mm_tokens_per_image": 256, "model_type": "gemma3",
        "text_config": {
            "hidden_size": 3840, "intermediate_size": 15360, "model_type": "gemma3_text",
            "num_attention_heads": 16, "num_hidden_layers": 48, "num_key_value_heads": 8,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024,
        },
        "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
        "vision_config": {"hidden_size": 1152, "image_size": 896, "model_type": "siglip_vision_model",
            "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": false},
    })
}

#[test]
fn gemma3_multimodal_folder_resolves_to_its_text_model() {
    let folder = gemma3_12b_folder();
    let spec = check(folder.clone()).unwrap();
    // The 12B text shape written out in full (transformers 5's form, every default spelled
    // out) is the same model: the defaults filled in are Gemma3TextConfig's, the RoPE bases
    // 1e6 and 1e4, the eos ids the wrapper's.
    let written_out = preset("gemma-3-12b").unwrap();
    let mut text = spec.clone();
    text.raw = written_out.raw.clone();
    text.multimodal = None;
    assert_eq!(text, written_out);
    let m = spec.multimodal.as_ref().unwrap();
    assert_eq!((m.model_type, m.architecture), ("gemma3", "Gemma3ForConditionalGeneration"));
    assert_eq!(m.config, folder);
    // Checkpoints carry the wrapper's config as read, in float32; the text model's own config
    // (the training state's, a reduced depth's) is a Gemma3ForCausalLM one.
    let wrapper = spec.wrapper_config().unwrap();
    for key in ["architectures", "model_type", "text_config", "vision_config", "eos_token_id"] {
        assert_eq!(wrapper[key], folder[key], "{key}");
    }
    assert_eq!(wrapper["torch_dtype"], "float32");
    let own = spec.to_hf_config();
    assert_eq!(
        (own["model_type"].as_str(), &own["architectures"]),
        (Some("gemma3_text"), &json!(["Gemma3ForCausalLM"]))
    );
    let again = check(own).unwrap();
    assert_eq!((again.multimodal, again.layers, again.vocab), (None, 48, 262_208));
    assert!(spec.with_layers(6).unwrap().multimodal.is_none());
    assert!(written_out.wrapper_config().is_none());

    // The 4B's text_config leaves out its heads too: Gemma3TextConfig's 8 and 4.
    let mut four = folder.clone();
    four["text_config"] = json!({"hidden_size": 2560, "intermediate_size": 10240,
        "model_type": "gemma3_text", "num_hidden_layers": 34, "sliding_window": 1024,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}});
    let four = check(four).unwrap();
    assert_eq!((four.q_heads, four.kv_heads, four.head_dim, four.vocab), (8, 4, 256, 262_208));
    assert_eq!(four.windows.iter().filter(|w| w.is_none()).count(), 5, "every sixth of 34");
    // Tied by the wrapper's own flag (transformers 5), whatever text_config says; a
    // final_logit_softcapping there is not applied by Gemma3ForConditionalGeneration.
    let mut untied = folder.clone();
    untied["tie_word_embeddings"] = json!(false);
    untied["text_config"]["tie_word_embeddings"] = json!(true);
    untied["text_config"]["final_logit_softcapping"] = json!(30.0);
    let untied = check(untied).unwrap();
    assert!(!untied.tie_embeddings);
    assert_eq!(untied.final_softcap, None);
    let mut tied = folder.clone();
    tied["text_config"]["tie_word_embeddings"] = json!(false);
    assert!(check(tied).unwrap().tie_embeddings);
}

#[test]
fn other_multimodal_folders_are_refused_by_name() {
    let llava = json!({"model_type": "llava", "architectures": ["LlavaForConditionalGeneration"],
        "text_config": {"model_type": "llama"}, "vision_config": {"model_type": "clip_vision_model"}});
    let e = message(check(llava));
    assert!(
        e.contains(
            "multimodal model_type \"llava\" (LlavaForConditionalGeneration) is not supported; \
             of multimodal folders Sluice trains only the text model of gemma3 \
             (Gemma3ForConditionalGeneration)"
        ),
        "{e}"
    );
    let mut qwen_vl = base("qwen2_5_vl");
    qwen_vl["vision_config"] = json!({"depth": 32});
    assert!(message(check(qwen_vl)).contains("multimodal model_type \"qwen2_5_vl\""));
    // A text family that is not supported is still named as such.
    assert!(message(check(base("gpt2"))).contains("unsupported model_type \"gpt2\""));

    let mut classifier = gemma3_12b_folder();
    classifier["architectures"] = json!(["Gemma3ForSequenceClassification"]);
    let e = message(check(classifier));
    assert!(e.contains("architecture \"Gemma3ForSequenceClassification\" of model_type \"gemma3\" is not supported"), "{e}");
    let mut bare = gemma3_12b_folder();
    bare.as_object_mut().unwrap().remove("text_config");
    assert!(message(check(bare)).contains("needs text_config"));
    let mut other = gemma3_12b_folder();
    other["text_config"]["model_type"] = json!("gemma2");
    assert!(
        message(check(other))
            .contains("text_config.model_type of a gemma3 config must be \"gemma3_text\"")
    );
    let mut heads = gemma3_12b_folder();
    heads["text_config"]["num_attention_heads"] = json!(12);
    let e = message(check(heads));
    assert!(
        e.contains("test/config.json: text_config: num_attention_heads (12) is not a multiple"),
        "{e}"
    );
}
