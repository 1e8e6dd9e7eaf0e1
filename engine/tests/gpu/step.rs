//! A decoder layer and whole training steps: every family, the streaming schedule, casting uploads
//! and determinism.

use crate::common::*;

pub(crate) fn spec_from(json: serde_json::Value) -> ModelSpec {
    ModelSpec::from_hf(json, &PathBuf::from("gpu-test")).expect("spec")
}

/// Odd-sized one-layer models of four families: biases on q/k/v and o (llama with
/// attention_bias), q/k norm with head_dim 128 (qwen3), a sliding window (mistral), partial
/// rotary with longrope's scaled cos and sin (phi3; documents of up to 15 positions against an
/// original 8, so the long factors), and Gemma 3's layer (offset and post norms, q/k norms,
/// GeGLU, its own score scale, a sliding layer with its local RoPE base), and Gemma 2's
/// (soft-capped scores).
pub(crate) fn layer_specs() -> Vec<(&'static str, ModelSpec)> {
    let base = |mt: &str| {
        serde_json::json!({
            "model_type": mt, "vocab_size": V, "hidden_size": H, "intermediate_size": I,
            "num_hidden_layers": 1, "num_attention_heads": 6, "num_key_value_heads": 2,
            "head_dim": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "tie_word_embeddings": false, "max_position_embeddings": 4096,
        })
    };
    let mut llama = base("llama");
    llama["attention_bias"] = true.into();
    let mut qwen3 = base("qwen3");
    qwen3["head_dim"] = 128.into();
    let mut mistral = base("mistral");
    mistral["sliding_window"] = 7.into();
    let mut gemma3 = base("gemma3_text");
    gemma3["query_pre_attn_scalar"] = 48.into();
    gemma3["sliding_window"] = 7.into();
    gemma3["layer_types"] = serde_json::json!(["sliding_attention"]);
    gemma3["rope_parameters"] = serde_json::json!({
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
    });
    let mut gemma2 = base("gemma2");
    gemma2["query_pre_attn_scalar"] = 32.into();
    gemma2["sliding_window"] = 7.into();
    gemma2["attn_logit_softcapping"] = 2.0.into();
    let mut phi3 = base("phi3");
    let factors = |f: f64| (0..24).map(|i| 1.0 + f * i as f64).collect::<Vec<_>>();
    phi3["rope_parameters"] = serde_json::json!({
        "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
        "original_max_position_embeddings": 8, "short_factor": factors(0.05),
        "long_factor": factors(0.5),
    });
    let mut mixtral = base("mixtral");
    mixtral["num_local_experts"] = 4.into();
    mixtral["num_experts_per_tok"] = 2.into();
    mixtral["output_router_logits"] = true.into();
    let mut qwen3_moe = base("qwen3_moe");
    qwen3_moe["num_experts"] = 8.into();
    qwen3_moe["num_experts_per_tok"] = 3.into();
    qwen3_moe["moe_intermediate_size"] = 40.into();
    qwen3_moe["norm_topk_prob"] = true.into();
    let mut qwen2_moe = base("qwen2_moe");
    qwen2_moe["num_experts"] = 4.into();
    qwen2_moe["num_experts_per_tok"] = 2.into();
    qwen2_moe["moe_intermediate_size"] = 40.into();
    qwen2_moe["shared_expert_intermediate_size"] = 56.into();
    let mut gpt_oss = base("gpt_oss");
    gpt_oss["num_local_experts"] = 4.into();
    gpt_oss["num_experts_per_tok"] = 2.into();
    gpt_oss["sliding_window"] = 7.into();
    gpt_oss["layer_types"] = serde_json::json!(["sliding_attention"]);
    gpt_oss["output_router_logits"] = true.into();
    gpt_oss["rope_parameters"] = serde_json::json!({
        "rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
        "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": false,
    });
    vec![
        ("mixtral 4 experts top 2", spec_from(mixtral)),
        ("qwen3_moe 8 experts top 3", spec_from(qwen3_moe)),
        ("qwen2_moe shared expert", spec_from(qwen2_moe)),
        ("gpt_oss sinks, biases, clamped", spec_from(gpt_oss)),
        ("llama+bias", spec_from(llama)),
        ("qwen3 hd=128", spec_from(qwen3)),
        ("mistral window=7", spec_from(mistral)),
        ("phi3 longrope rotary=48", spec_from(phi3)),
        ("gemma3 sliding local rope", spec_from(gemma3)),
        ("gemma2 soft-capped", spec_from(gemma2)),
    ]
}

/// Every parameter rounded to bf16, as the GPU stores them, so both backends see the same model.
pub(crate) fn bf16_params(spec: &ModelSpec, seed: u64) -> HostParams {
    let mut p = HostParams::random(spec, seed);
    // Larger than transformers' init (0.02) so the layer's branches matter against the residual.
    let mut r = rng(seed);
    for u in &mut p.units {
        for x in u.iter_mut() {
            if *x != 0.0 && *x != 1.0 {
                *x *= 5.0;
            } else if *x == 1.0 {
                *x += r.random_range(-0.1..0.1);
            }
            *x = bf16::from_f32(*x).to_f32();
        }
    }
    p
}

pub(crate) struct LayerResult {
    out: Vec<f32>,
    dx_in: Vec<f32>,
    grad: Vec<f32>,
    /// A MoE layer's router logits `[T, E]`.
    router: Option<Vec<f32>>,
}

/// The smallest gap, over tokens, between the last expert a token is routed to and the first
/// it is not, relative to the row's largest logit: below bf16's rounding of the router's input
/// (about 1e-2 here) the two backends may route a token differently, both correctly.
pub(crate) fn routing_margin(logits: &[f32], experts: usize, top_k: usize) -> f32 {
    logits
        .chunks(experts)
        .map(|row| {
            let mut z = row.to_vec();
            z.sort_by(|a, b| b.total_cmp(a));
            let scale = z.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
            (z[top_k - 1] - z[top_k]) / scale
        })
        .fold(f32::INFINITY, f32::min)
}

pub(crate) fn run_layer<B: Backend>(
    b: &B,
    spec: &ModelSpec,
    p: &HostParams,
    x: &[f32],
    dx_out: &[f32],
) -> LayerResult {
    let layout = p.layout.clone();
    let dec = Decoder::new(b, spec, layout.layers.clone(), layout.head.clone()).expect("decoder");
    let w = put(b, &p.units[1], Activation);
    let mut grad = b.alloc(p.units[1].len(), Accum).expect("grad");
    let x_in = put(b, x, Activation);
    let dxo = put(b, dx_out, Activation);
    let mut out = nan(b, T * H, Activation);
    let mut dx_in = nan(b, T * H, Activation);
    let mut batch = DeviceBatch::new(b, T).expect("batch");
    let ids: Vec<i32> = (0..T as i32).collect();
    batch.upload(b, &ids, &positions(), &ids, &CU).expect("batch upload");
    let mut s = LayerScratch::new(b, spec, T).expect("scratch");
    let at = || LayerAt::packed(&batch, 0);
    dec.layer_forward(b, &mut out, &x_in, &w, &mut s, at()).expect("layer forward");
    let grads = LayerGrads { dx_out: &dxo, dx_in: &mut dx_in, weights: &mut grad };
    dec.layer_backward(b, grads, &x_in, &w, &mut s, at()).expect("layer backward");
    let router = s.router_logits(b, T).expect("router logits");
    LayerResult { out: get(b, &out), dx_in: get(b, &dx_in), grad: get(b, &grad), router }
}

#[test]
pub(crate) fn decoder_layer_forward_and_backward() {
    for (name, spec) in layer_specs() {
        let p = bf16_params(&spec, 20);
        // A MoE layer takes the first input whose every token has a clear routing decision
        // (a gap of 3% of the row's largest logit): routing itself is compared op by op in
        // `moe_routing_and_its_backward`, ties included.
        let (x, dx_out, want) = (21..)
            .map(|seed| {
                let mut r = rng(seed);
                let x = round_bf16(&uniform(&mut r, T * H, 1.0));
                let dx_out = round_bf16(&uniform(&mut r, T * H, 1.0));
                let want = run_layer(&Cpu::new(), &spec, &p, &x, &dx_out);
                (x, dx_out, want)
            })
            .take(200)
            .find(|(_, _, want)| match (&want.router, &spec.moe) {
                (Some(z), Some(m)) => routing_margin(z, m.experts, m.top_k) >= 3e-2,
                _ => true,
            })
            .expect("an input with clear routing decisions");
        let got = run_layer(gpu(), &spec, &p, &x, &dx_out);
        // bf16 intermediates through ~10 ops (norms, 4 GEMMs, attention): a few bf16 ulps.
        check(&format!("decoder layer {name}: output"), &got.out, &want.out, 2e-2);
        check(&format!("decoder layer {name}: dx_in"), &got.dx_in, &want.dx_in, 3e-2);
        for (u, t) in p.layout.tensors().filter(|(u, _)| *u == 1) {
            let _ = u;
            let r = t.range.clone();
            check(
                &format!("decoder layer {name}: grad {}", t.name),
                &got.grad[r.clone()],
                &want.grad[r],
                3e-2,
            );
        }
    }
}

pub(crate) fn random_batch(vocab: usize, rows: usize, seq: usize, seed: u64) -> MicroBatch {
    let mut r = rng(seed);
    let t = rows * seq;
    let ids: Vec<i32> = (0..t).map(|_| r.random_range(0..vocab as i32)).collect();
    // Two documents per row (split at a random point); the first 3 tokens of each row are
    // prompt (no loss), and the last token of each document has no target.
    let mut cu = vec![0i32];
    let mut positions = Vec::new();
    let mut targets = vec![IGNORE; t];
    for row in 0..rows {
        let split = r.random_range(2..seq - 2);
        for (a, b) in [(0, split), (split, seq)] {
            let (a, b) = (row * seq + a, row * seq + b);
            positions.extend(0..(b - a) as i32);
            for i in a..b - 1 {
                if i - row * seq >= 3 {
                    targets[i] = ids[i + 1];
                }
            }
            cu.push(b as i32);
        }
    }
    MicroBatch { rows, seq_len: seq, ids, targets, positions, cu_seqlens: cu }
}

pub(crate) fn config() -> TrainConfig {
    TrainConfig { lr: 1e-3, total_steps: 10, max_grad_norm: Some(1.0), ..TrainConfig::default() }
}

/// Loss, every gradient and a 3-step trajectory of the GPU trainer against the CPU trainer on
/// the same bf16-rounded model and batches.
pub(crate) fn training_step_case(
    name: &str,
    spec: &ModelSpec,
    p: HostParams,
    batches: &[MicroBatch],
) {
    training_step_case_within(name, spec, p, batches, 5e-2)
}

/// [`training_step_case`] with its own gradient tolerance (relative to each tensor's scale).
pub(crate) fn training_step_case_within(
    name: &str,
    spec: &ModelSpec,
    p: HostParams,
    batches: &[MicroBatch],
    tol: f64,
) {
    let max_tokens = batches.iter().map(|b| b.ids.len()).max().unwrap_or(1);
    let cpu = Cpu::new();
    let mut tc = Trainer::new(&cpu, spec, p.clone(), config(), max_tokens).expect("cpu trainer");
    let mut tg = Trainer::new(gpu(), spec, p.clone(), config(), max_tokens).expect("gpu trainer");
    let (lc, gc) = tc.loss_and_grads(batches).expect("cpu grads");
    let gc = gc.to_vec();
    let (lg, gg) = tg.loss_and_grads(batches).expect("gpu grads");
    let gg = gg.to_vec();
    // The loss is a mean over tokens of log-sum-exps: bf16 activations move it by ~1e-3.
    check(&format!("train step {name}: loss"), &[lg as f32], &[lc as f32], 5e-3);
    // Gradients pass through every layer's bf16 activations backwards: `tol` of each tensor's
    // scale (a wrong op gives errors of order 1).
    let (mut worst, mut worst_name) = (0f64, String::new());
    let mut failures = Vec::new();
    let max_abs = |v: &[f32]| v.iter().fold(0f64, |m, &x| m.max(f64::from(x).abs()));
    for (u, t) in p.layout.tensors() {
        let r = t.range.clone();
        let (mut e, at) = rel_err(&gg[u][r.clone()], &gc[u][r.clone()]);
        if let Some(layer) = t.name.strip_suffix("k_proj.bias") {
            // A key bias shifts every score of a query by nearly the same amount (exactly the
            // same but for RoPE's rotation), which the softmax ignores: its gradient is a sum
            // of terms that nearly cancel, so bf16 rounding noise dominates it. Measure that
            // noise against the scale of the same layer's query-bias gradient instead.
            let q = p.layout.tensors().find(|(_, q)| q.name == format!("{layer}q_proj.bias"));
            let (qu, qt) = q.expect("a layer with a key bias has a query bias");
            let scale = max_abs(&gc[qu][qt.range.clone()]).max(1e-30);
            let diff: Vec<f32> =
                gg[u][r.clone()].iter().zip(&gc[u][r.clone()]).map(|(a, b)| a - b).collect();
            e = max_abs(&diff) / scale;
        }
        if e > tol {
            failures.push(format!("{} off by {e:.3e} at {at}", t.name));
        }
        if e >= worst {
            (worst, worst_name) = (e, t.name.clone());
        }
    }
    // Every tensor is checked before failing, so the message shows where errors concentrate.
    assert!(failures.is_empty(), "{name}: gradients beyond {tol:.0e}: {failures:#?}");
    record(&format!("train step {name}: worst gradient ({worst_name})"), worst, tol);
    for step in 0..3 {
        let mc = tc.step(batches).expect("cpu step");
        let mg = tg.step(batches).expect("gpu step");
        check(
            &format!("train step {name}: loss after {step} updates"),
            &[mg.loss as f32],
            &[mc.loss as f32],
            1e-2,
        );
        check(
            &format!("train step {name}: grad norm step {step}"),
            &[mg.grad_norm as f32],
            &[mc.grad_norm as f32],
            5e-2,
        );
    }
}

#[test]
pub(crate) fn training_step_tiny_preset() {
    let spec = preset("tiny").expect("tiny preset");
    let p = bf16_params(&spec, 30);
    let batches = [random_batch(spec.vocab, 2, 48, 31), random_batch(spec.vocab, 3, 19, 32)];
    training_step_case("tiny preset", &spec, p, &batches);
}

/// The golden fixtures' folder: `tests/golden` under the working directory (the repository
/// root on the GPU machine), else beside this crate.
pub(crate) fn golden_dir(case: &str) -> PathBuf {
    let here = PathBuf::from("tests/golden").join(case);
    if here.is_dir() {
        return here;
    }
    let built = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/golden").join(case);
    assert!(built.is_dir(), "no tests/golden/{case}: run from the repository root");
    built
}

/// The smallest [`routing_margin`] over every MoE layer of the model for `mb`, on the CPU
/// (infinite for a dense model): the trainer's forward, layer by layer, reading each layer's
/// router logits.
pub(crate) fn model_routing_margin(spec: &ModelSpec, p: &HostParams, mb: &MicroBatch) -> f32 {
    let Some(moe) = &spec.moe else { return f32::INFINITY };
    let c = Cpu::new();
    let dec =
        Decoder::new(&c, spec, p.layout.layers.clone(), p.layout.head.clone()).expect("decoder");
    let t = mb.ids.len();
    let mut batch = DeviceBatch::new(&c, t).expect("batch");
    batch.upload(&c, &mb.ids, &mb.positions, &mb.targets, &mb.cu_seqlens).expect("upload");
    let mut s = LayerScratch::new(&c, spec, t).expect("scratch");
    let mut x = c.alloc(t * spec.hidden, Activation).expect("x");
    dec.embed_forward(&c, &mut x, &put(&c, &p.units[0], Activation), &batch).expect("embed");
    let mut margin = f32::INFINITY;
    for l in 0..spec.layers {
        let mut out = c.alloc(t * spec.hidden, Activation).expect("out");
        let w = put(&c, &p.units[l + 1], Activation);
        dec.layer_forward(&c, &mut out, &x, &w, &mut s, LayerAt::packed(&batch, l))
            .expect("layer forward");
        if let Some(z) = s.router_logits(&c, t).expect("router logits") {
            margin = margin.min(routing_margin(&z, moe.experts, moe.top_k));
        }
        x = out;
    }
    margin
}

#[test]
pub(crate) fn training_step_every_family() {
    for case in cases::GOLDEN_CASES {
        let (spec, mut p) = HostParams::load_dir(&golden_dir(case)).expect("golden model");
        for u in &mut p.units {
            u.iter_mut().for_each(|x| *x = bf16::from_f32(*x).to_f32());
        }
        // GPT-OSS trains on the first batches whose every token has a clear routing decision
        // in both layers on the CPU (as `decoder_layer_forward_and_backward` picks its inputs):
        // a token whose top experts' logits nearly tie may go to another expert on the GPU,
        // both correctly. Seeds 40 and 41 leave gaps of 0.8% and 0.2% of the largest logit,
        // and a change of where the GPU rounds (the residual added in the GEMM's epilogue)
        // moved its gradients by 20 to 70% of their scale and the loss by 4e-3. Routing
        // itself, ties included, is compared op by op in `moe_routing_and_its_backward`.
        // (Qwen3-MoE's case has exact ties, the same on both backends.)
        let batch = |rows, seq, seed: u64| {
            (seed..seed + 400)
                .step_by(2)
                .map(|s| random_batch(spec.vocab, rows, seq, s))
                .find(|mb| case != "gpt_oss" || model_routing_margin(&spec, &p, mb) >= 1e-2)
                .expect("a batch with clear routing decisions")
        };
        let batches = [batch(2, 13, 40), batch(1, 29, 41)];
        // Gemma 3's case rounds four norm outputs a layer to bf16, and its q/k norms and
        // scores scaled by 1/2 (query_pre_attn_scalar 4 at head_dim 8) make the softmax sharp,
        // so the query and key gradients of its first layer, three layers of bf16 activation
        // gradients down, carry more rounding noise: 5.7e-2 of the scale of layer 0's q_proj
        // gradient on the H200 (2026-12-03), where every op of its layer matches the CPU alone
        // (`decoder_layer_forward_and_backward`) and a Gemma-3-1B step matches transformers'
        // bf16 step within 1.2e-3 in every unit's gradient norm (scripts/gpu/compare_step.py).
        // 1e-1 still fails a wrong op.
        //
        // GPT-OSS's case drives its clamped SwiGLU past the clamp on purpose (the golden
        // fixture checks the clamp is exercised), and a clamp's gradient jumps from a full
        // value to 0 at the limit: a gate value that bf16 rounds to the other side of 7 moves
        // that element's gradient by its whole size, and with its router in bf16 a token
        // whose two expert logits nearly tie may go to the other expert. Measured on the H200
        // (2026-12-03): the layers' gate_up_proj gradients (weight and bias) off by up to
        // 1.5e-1 of their scale, the sinks and the embedding by 5e-2 to 7e-2, everything else
        // within 5e-2 and the loss within 7e-5; a single gpt_oss layer with clear routing
        // matches every gradient within 2e-2 (`decoder_layer_forward_and_backward`) and a
        // 6-layer gpt-oss-20b step matches transformers' bf16 step within 3.3e-3 in every
        // unit's gradient norm (scripts/gpu/compare_step.py). 2e-1 still fails a wrong op.
        let tol = match case {
            "gemma3" => 1e-1,
            "gpt_oss" => 2e-1,
            _ => 5e-2,
        };
        training_step_case_within(case, &spec, p, &batches, tol);
    }
}

/// The streaming schedule on the GPU (asynchronous copies on their own streams, weight
/// prefetch, resident units beside streamed ones, every gradient tier, both checkpoint tiers)
/// against the reference loop on the GPU.
/// Untied models run the same ops in the same order, so the losses and the weights are equal
/// bit for bit: a copy racing the compute that reads or reuses its buffer would show here. A
/// tied embedding sums its two gradient parts in another order: 1e-5 of the loss (bf16
/// activations make its last bits move more than on the CPU) and 1e-2 of the weights' scale.
#[test]
pub(crate) fn streaming_schedule_matches_the_reference_loop() {
    use GradientTier::{DeviceStore, HostRing, HostStore, HostStoreBf16};
    // (checkpoint tier, checkpoint interval K, gradient tier, clipping, weight source, ring
    // slots, moments on disk); the fixtures have 2 layers, so K = 2 recomputes layer 1's input from layer 0's
    // checkpoint.
    use WeightSource::{Master, StreamingCopy};
    let tiers = [
        (CheckpointTier::Host, 1, HostStore, Some(1.0), StreamingCopy, RING_SLOTS, false),
        (CheckpointTier::Host, 2, DeviceStore, Some(1.0), StreamingCopy, RING_SLOTS, false),
        (CheckpointTier::Device, 1, HostRing, None, StreamingCopy, RING_SLOTS, false),
        (CheckpointTier::Device, 2, DeviceStore, None, StreamingCopy, RING_SLOTS, false),
        // The fp32 master cast on the device rounds as the host's copy does: the same bits.
        (CheckpointTier::Host, 1, HostStore, Some(1.0), Master, RING_SLOTS, false),
        (CheckpointTier::Device, 1, HostRing, None, Master, RING_SLOTS, false),
        // bf16 gradients for AdamW (the norm from fp32): close, not equal.
        (CheckpointTier::Device, 1, HostStoreBf16, Some(1.0), Master, RING_SLOTS, false),
        // Two ring slots (host memory short): every landing waits for the update two back.
        (CheckpointTier::Device, 1, HostRing, None, Master, 2, false),
        (CheckpointTier::Host, 2, DeviceStore, Some(1.0), Master, 2, false),
        // Every unit's Adam moments on the disk tier: read into staging, updated by the fused
        // bf16 AdamW, written back; the same bits.
        (CheckpointTier::Device, 1, HostRing, None, Master, RING_SLOTS, true),
        (CheckpointTier::Host, 1, HostStore, Some(1.0), StreamingCopy, RING_SLOTS, true),
    ];
    for case in ["llama", "qwen2", "mistral", "phi3", "gemma3", "gemma2", "mixtral", "gpt_oss"] {
        let (spec, p) = HostParams::load_dir(&golden_dir(case)).expect("golden model");
        let steps: Vec<Vec<MicroBatch>> = (0..3)
            .map(|k| (0..3).map(|b| random_batch(spec.vocab, 2, 21, 60 + 3 * k + b)).collect())
            .collect();
        let tied = spec.tie_embeddings;
        for (n, &(checkpoints, interval, gradients, clip, weights, ring_slots, on_disk)) in
            tiers.iter().enumerate()
        {
            // Every other case keeps the odd units resident beside the streamed ones: their
            // uploads are prefetched a layer ahead and wait only for their own slot's last read.
            let resident: Vec<usize> =
                if n % 2 == 1 { (1..spec.layers + 2).step_by(2).collect() } else { Vec::new() };
            let what = format!(
                "{case} {checkpoints:?} checkpoints every {interval}, {gradients:?} \
                 ({ring_slots} ring slots), {weights:?}, moments on disk: {on_disk}, \
                 resident units {resident:?}"
            );
            let tier_dir = tempfile::tempdir().expect("a folder for the disk tier");
            let keeps = checkpoints == CheckpointTier::Device && interval == 1;
            let cfg = TrainConfig { max_grad_norm: clip, ..config() };
            let mut reference =
                Trainer::new(gpu(), &spec, p.clone(), cfg.clone(), 42).expect("trainer");
            let options = ScheduleOptions {
                max_tokens: 42,
                grad_accum: 3,
                checkpoints,
                checkpoint_interval: interval,
                optimizer_threads: 4,
                resident,
                gradients,
                weights,
                ring_slots,
                disk: on_disk.then(|| DiskOptions {
                    dir: tier_dir.path().to_path_buf(),
                    units: (0..spec.layers + 2).collect(),
                }),
                // With every input checkpointed on the device, dense layers keep layer 0's
                // activations (no recompute) beside layer 1's recompute, which in every other
                // case skips its attention (its output kept); a mixture of experts keeps
                // layer 1's attention output in those cases.
                kept: if keeps && spec.moe.is_none() { vec![0] } else { Vec::new() },
                kept_attention: if keeps && n % 2 == 0 { vec![1] } else { Vec::new() },
            };
            let mut streamer =
                Streamer::new(gpu(), &spec, p.clone(), cfg, options).expect("streamer");
            for (k, micro) in steps.iter().enumerate() {
                let want = reference.step(micro).expect("reference step");
                let (got, _) = streamer.step(micro).expect("streaming step");
                let rounded = gradients == HostStoreBf16;
                // bf16 gradients move AdamW's updates by up to 2^-9 of each; GPT-OSS's
                // clamped SwiGLU and router turn that into larger loss changes where a value
                // crosses the clamp or a token changes expert (1.0e-3 after two updates on the
                // H200, 2026-12-03), the others stay under 1e-3.
                let tol = if rounded && case == "gpt_oss" {
                    3e-3
                } else if rounded {
                    1e-3
                } else if tied {
                    1e-5
                } else {
                    0.0
                };
                assert!(
                    (got.loss - want.loss).abs() <= tol * want.loss.abs(),
                    "{what} step {k}: loss {} vs {}",
                    got.loss,
                    want.loss
                );
                // The first step's norm comes from the same fp32 gradients: exact clipping.
                if rounded && k == 0 && !tied {
                    assert_eq!(got.grad_norm, want.grad_norm, "{what}: the norm moved");
                }
            }
            let got = streamer.finish().expect("finish");
            let mut worst = 0f64;
            for (a, b) in got.units.iter().zip(&reference.params.units) {
                worst = worst.max(rel_err(a, b).0);
            }
            let tol = if gradients == HostStoreBf16 || tied { 1e-2 } else { 0.0 };
            assert!(worst <= tol, "{what}: weights differ by {worst:.3e} of their scale");
            record(&format!("streaming vs reference loop: {what}"), worst, tol.max(1e-30));
        }
    }
}

/// Weights streamed from the fp32 master: copied up a staging chunk at a time and cast on the
/// copy stream. Many chunks and a short last one, against the host's rounding bit for bit:
/// ties to even both ways, subnormals, infinities and the largest finite values.
#[test]
pub(crate) fn a_casting_upload_rounds_as_the_host_does() {
    let g = gpu();
    let n = 10_007;
    let mut rng = ChaCha8Rng::seed_from_u64(77);
    let mut values: Vec<f32> = (0..n).map(|_| rng.random_range(-3.0f32..3.0)).collect();
    let special = [
        1.0 + 1.0 / 256.0,
        1.0 + 3.0 / 256.0,
        -(1.0 + 1.0 / 256.0),
        f32::from_bits(0x0000_8000),
        f32::from_bits(0x8001_7fff),
        f32::MIN_POSITIVE,
        f32::MAX,
        f32::MIN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        0.0,
        -0.0,
    ];
    values[..special.len()].copy_from_slice(&special);
    let mut slab = HostSlab::zeroed(n * 4).expect("slab");
    slab.as_f32_mut().copy_from_slice(&values);
    g.pin(&mut slab).expect("pin");
    let mut out = g.alloc(n, Activation).expect("alloc");
    let mut staging = g.alloc(1000, Accum).expect("staging");
    let stream = g.new_stream().expect("stream");
    let done = g.new_event().expect("event");
    // SAFETY: the slab, the output and the staging outlive the synchronisation below, and
    // nothing else touches them until then.
    unsafe {
        g.upload_f32_on(&stream, g.view_mut(&mut out, 0..n), &slab, 0, Some(&mut staging))
            .expect("casting upload");
    }
    g.record(&done, &stream).expect("record");
    Device::synchronize(g, &done).expect("sync");
    let mut got = vec![0f32; n];
    g.download(&mut got, g.view(&out, 0..n)).expect("download");
    let bad = got
        .iter()
        .zip(&values)
        .filter(|(a, x)| a.to_bits() != bf16::from_f32(**x).to_f32().to_bits())
        .count();
    assert_eq!(bad, 0, "{bad} of {n} elements round differently from the host");
    // A bf16 destination without staging is refused, not left half-written.
    // SAFETY: as above; the call queues nothing when it fails.
    let err = unsafe { g.upload_f32_on(&stream, g.view_mut(&mut out, 0..n), &slab, 0, None) }
        .expect_err("no staging");
    assert!(err.to_string().contains("staging"), "{err}");
    println!("casting upload: {n} elements through 1000-element chunks, bit-exact");
}

#[test]
pub(crate) fn two_runs_give_identical_bits() {
    let spec = preset("tiny").expect("tiny preset");
    let p = bf16_params(&spec, 50);
    let batches = [random_batch(spec.vocab, 2, 48, 51)];
    let run = || {
        let mut t = Trainer::new(gpu(), &spec, p.clone(), config(), 96).expect("trainer");
        let losses: Vec<u64> =
            (0..2).map(|_| t.step(&batches).expect("step").loss.to_bits()).collect();
        (losses, t.params.units.clone())
    };
    let (a, b) = (run(), run());
    assert_eq!(a.0, b.0, "losses differ between identical runs");
    assert!(a.1 == b.1, "weights differ between identical runs");
    println!("two identical runs: identical losses and weights after 2 steps");
}
