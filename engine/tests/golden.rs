//! The CPU reference against Hugging Face transformers on tiny random models of every family.
//!
//! Fixtures (`tests/golden/<case>/`, made by `scripts/golden/make_fixtures.py` in float32 with
//! eager attention) hold a model, a batch, transformers' logits, loss, every parameter gradient,
//! and a 5-step AdamW trajectory with clipping and a cosine schedule; the check and its
//! tolerances are `support/golden.rs`'s.

use sluice_engine::model::HostParams;

#[path = "support/cases.rs"]
mod cases;
use cases::GOLDEN_CASES as CASES;

#[path = "support/golden.rs"]
mod golden;

fn check(case: &str) {
    let (spec, params) = HostParams::load_dir(&golden::case_dir(case)).expect("model loads");
    golden::check_against(case, case, &spec, params);
}

#[test]
fn golden_llama() {
    check(CASES[0]);
}

#[test]
fn golden_llama_linear_rope_tied() {
    check(CASES[1]);
}

#[test]
fn golden_qwen2() {
    check(CASES[2]);
}

#[test]
fn golden_qwen3() {
    check(CASES[3]);
}

#[test]
fn golden_mistral_sliding_window() {
    check(CASES[4]);
}

#[test]
fn golden_phi3_fused_longrope_partial_rotary() {
    check(CASES[5]);
}

#[test]
fn golden_gemma3_local_global_layers() {
    check(CASES[6]);
}

#[test]
fn golden_gemma2_softcaps_and_alternating_windows() {
    check(CASES[7]);
}

#[test]
fn golden_mixtral_top2_of_4_experts_with_load_balancing_loss() {
    check(CASES[8]);
}

#[test]
fn golden_qwen3_moe_dense_then_sparse_layer() {
    check(CASES[9]);
}

#[test]
fn golden_gpt_oss_sinks_yarn_biased_router_clamped_swiglu() {
    check(CASES[10]);
}

#[test]
fn golden_qwen2_moe_shared_expert_and_its_gate() {
    check(CASES[11]);
}
