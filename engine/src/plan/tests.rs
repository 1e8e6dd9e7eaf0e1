//! The planner against budgets computed by hand from the published model shapes.

use super::*;
use crate::placement::CAST_CHUNK;
use crate::spec::preset;

const GIB: u64 = 1 << 30;
/// The H200 test machine: 139 GiB of GPU memory, 125 GiB of host RAM.
const H200: (u64, u64) = (139 * GIB, 125 * GIB);

fn check(name: &str, batch: (usize, usize, usize), mem: (u64, u64), clipping: bool) -> Verdict {
    let spec = preset(name).expect("preset");
    let (seq_len, micro_batch, grad_accum) = batch;
    let input = PlanInput {
        spec: &spec,
        batch: BatchShape { seq_len, micro_batch, grad_accum },
        clipping,
        memory: MachineMemory::given(mem.0, mem.1),
        rates: MachineRates::default(),
        supports: Capabilities::ALL,
        gpus: 1,
    };
    plan(&input).expect("valid input")
}

fn fits(v: Verdict) -> Plan {
    match v {
        Verdict::Fits(p) => *p,
        Verdict::Refused(r) => panic!("refused: {}", r.details()),
    }
}

fn refused(v: Verdict) -> Refusal {
    match v {
        Verdict::Refused(r) => *r,
        Verdict::Fits(p) => panic!("expected a refusal, got\n{p}"),
    }
}

/// The shapes by hand (config.json of each model), independent of `ModelSpec`'s arithmetic.
struct Shape {
    vocab: u64,
    hidden: u64,
    inter: u64,
    layers: u64,
    q_heads: u64,
    kv_heads: u64,
    head_dim: u64,
    qkv_bias: bool,
}

impl Shape {
    fn qkv(&self) -> u64 {
        (self.q_heads + 2 * self.kv_heads) * self.head_dim
    }
    fn att(&self) -> u64 {
        self.q_heads * self.head_dim
    }
    fn layer(&self) -> u64 {
        let h = self.hidden;
        2 * h
            + self.qkv() * h
            + h * self.att()
            + 3 * self.inter * h
            + if self.qkv_bias { self.qkv() } else { 0 }
    }
    /// Untied: embedding + layers + final norm + LM head.
    fn params(&self) -> u64 {
        2 * self.vocab * self.hidden + self.layers * self.layer() + self.hidden
    }
}

const QWEN7: Shape = Shape {
    vocab: 152064,
    hidden: 3584,
    inter: 18944,
    layers: 28,
    q_heads: 28,
    kv_heads: 4,
    head_dim: 128,
    qkv_bias: true,
};
const LLAMA8: Shape = Shape {
    vocab: 128256,
    hidden: 4096,
    inter: 14336,
    layers: 32,
    q_heads: 32,
    kv_heads: 8,
    head_dim: 128,
    qkv_bias: false,
};
const QWEN14: Shape = Shape {
    vocab: 152064,
    hidden: 5120,
    inter: 13824,
    layers: 48,
    q_heads: 40,
    kv_heads: 8,
    head_dim: 128,
    qkv_bias: true,
};
const QWEN72: Shape = Shape {
    vocab: 152064,
    hidden: 8192,
    inter: 29568,
    layers: 80,
    q_heads: 64,
    kv_heads: 8,
    head_dim: 128,
    qkv_bias: true,
};

const LLAMA70: Shape = Shape {
    vocab: 128256,
    hidden: 8192,
    inter: 28672,
    layers: 80,
    q_heads: 64,
    kv_heads: 8,
    head_dim: 128,
    qkv_bias: false,
};

#[test]
fn hand_shapes_match_the_published_parameter_counts() {
    // Hugging Face model cards: 7.62B, 8.03B, 14.8B, 72.7B, 70.6B.
    assert_eq!(QWEN7.params(), 7_615_616_512);
    assert_eq!(LLAMA8.params(), 8_030_261_248);
    assert_eq!(QWEN14.params(), 14_770_033_664);
    assert_eq!(QWEN72.params(), 72_706_203_648);
    assert_eq!(LLAMA70.params(), 70_553_706_496);
    // The presets plan with those counts.
    for (name, shape) in [("llama3-70b", &LLAMA70), ("qwen2.5-72b", &QWEN72)] {
        let huge = (139 * GIB, 4096 * GIB);
        assert_eq!(fits(check(name, (1024, 8, 8), huge, true)).model.params, shape.params());
    }
}

#[test]
fn seven_b_on_a_24_gib_gpu_with_exact_clipping_keeps_its_gradients_in_bf16() {
    // Where neither fp32 store fits (the device has no room for 30 GB of gradients, and 110
    // GiB of host memory none for them beside the master and moments), they wait rounded to
    // bf16 after the fp32 norm: 14 bytes per parameter plus staging.
    let plan = fits(check("qwen2.5-7b", (1024, 8, 8), (24 * GIB, 110 * GIB), true));
    assert_eq!(plan.placement.gradients, GradientTier::HostStoreBf16, "{plan}");
    assert_eq!(plan.placement.weights, WeightSource::Master, "{plan}");
    let p = QWEN7.params();
    assert_eq!(plan.budget.pinned_host.part("gradient store (bf16"), 2 * p);
    let per_param = plan.budget.host_used() as f64 / p as f64;
    assert!((14.0..14.5).contains(&per_param), "{per_param:.2}\n{plan}");
    // With an fp32 store that fits (125 GiB), the exact gradients win.
    let roomy = fits(check("qwen2.5-7b", (1024, 8, 8), (24 * GIB, 125 * GIB), true));
    assert_eq!(roomy.placement.gradients, GradientTier::HostStore, "{roomy}");
    // Unless the user asks for bf16 gradients: then 125 GiB holds them too.
    let asked =
        Capabilities { only_gradients: Some(GradientTier::HostStoreBf16), ..Capabilities::ALL };
    let memory = MachineMemory::given(24 * GIB, 125 * GIB);
    let chosen = fits(plan_with("qwen2.5-7b", (1024, 8, 8), memory, asked));
    assert_eq!(chosen.placement.gradients, GradientTier::HostStoreBf16, "{chosen}");
    // The rounded gradients cross PCIe at half the bytes.
    let grads = |plan: &Plan| plan.time.d2h_bytes;
    assert_eq!(2 * grads(&plan), grads(&roomy));
}

#[test]
fn a_copy_no_faster_than_the_master_is_not_kept() {
    // 7B on a 24 GiB GPU without clipping: a bf16 copy would save 0.5% of the step and cost 2
    // host bytes per parameter. Host memory bounds the models a machine trains, so the master
    // streams itself: 12 bytes per parameter for master and moments, plus the ring and the
    // host checkpoints.
    let plan = fits(check("qwen2.5-7b", (1024, 8, 8), (24 * GIB, 125 * GIB), false));
    assert_eq!(plan.placement.weights, WeightSource::Master, "{plan}");
    assert_eq!(plan.budget.pinned_host.part("bf16 streaming copy"), 0, "{plan}");
    // With host memory for only the master, the moments and a two-slot ring, the planner
    // finds the placement that fits (checkpoints on the device every 2 layers): under 12.6
    // host bytes per parameter.
    let lean = fits(check("qwen2.5-7b", (1024, 8, 8), (24 * GIB, 90 * GIB), false));
    assert_eq!(lean.placement.ring_slots, 2, "{lean}");
    let per_param = lean.budget.host_used() as f64 / QWEN7.params() as f64;
    assert!(per_param < 12.6, "{per_param:.2}\n{lean}");
}

fn plan_with_clip(clipping: bool, input: &PlanInput<'_>) -> Verdict {
    plan(&PlanInput { clipping, ..input.clone() }).expect("valid")
}

#[test]
fn every_gradient_policy_is_planned_with_its_memory_and_its_effect() {
    // 7B on a 24 GiB GPU with 110 GiB of host memory: neither fp32 store fits, bf16 gradients
    // and the unclipped ring do, the ring with 2 host bytes per parameter less.
    let spec = preset("qwen2.5-7b").expect("preset");
    let input = PlanInput {
        spec: &spec,
        batch: BatchShape { seq_len: 1024, micro_batch: 8, grad_accum: 8 },
        clipping: true,
        memory: MachineMemory::given(24 * GIB, 110 * GIB),
        rates: MachineRates::default(),
        supports: Capabilities::ALL,
        gpus: 1,
    };
    let options = gradient_options(&input).expect("valid");
    let tiers: Vec<_> = options.iter().map(|o| o.gradients).collect();
    assert_eq!(tiers, GradientTier::ALL);
    let fit: Vec<_> = options.iter().map(|o| o.fits).collect();
    assert_eq!(fit, [false, false, true, true], "{options:#?}");
    let [device, host, bf16, ring] = &options[..] else { unreachable!() };
    let (ring, bf16) = (ring.clone(), bf16.clone());
    assert!(device.refused.as_deref().unwrap_or("").contains("device"), "{device:?}");
    assert!(host.refused.as_deref().unwrap_or("").contains("host"), "{host:?}");
    assert!(host.host_bytes > input.memory.host_bytes, "{host:?}");
    // The ring needs no store: with the same memory it is no slower (the planner spends the
    // room on speed, within the 1% it gives up to stream the master instead of a copy), and
    // it alone fits 96 GiB: 12 bytes per parameter of master and moments,
    // plus the ring's slots of the largest unit (the 2 GiB embedding, 1.15 bytes per parameter).
    let (r, b) = (ring.step_s.expect("timed"), bf16.step_s.expect("timed"));
    assert!(r <= b * 1.01, "{ring:?} {bf16:?}");
    let tight = PlanInput { memory: MachineMemory::given(24 * GIB, 96 * GIB), ..input.clone() };
    let options = gradient_options(&tight).expect("valid");
    let fit: Vec<_> = options.iter().map(|o| o.fits).collect();
    assert_eq!(fit, [false, false, false, true], "{options:#?}");
    assert!((13.0..13.3).contains(&options[3].host_bytes_per_param), "{:?}", options[3]);
    assert!(options[2].host_bytes > 96 * GIB, "{:?}", options[2]);
    // With less, the ring keeps two slots instead of four: 2 x 2 GiB less.
    let tighter = PlanInput { memory: MachineMemory::given(24 * GIB, 90 * GIB), ..input.clone() };
    let plan = fits(plan(&PlanInput { clipping: false, ..tighter }).expect("valid"));
    assert_eq!((plan.placement.gradients, plan.placement.ring_slots), (GradientTier::HostRing, 2));
    let per_param = plan.budget.host_used() as f64 / QWEN7.params() as f64;
    assert!((12.5..12.7).contains(&per_param), "{per_param:.2}\n{plan}");
    let roomy = fits(plan_with_clip(false, &input));
    assert_eq!(roomy.placement.ring_slots, RING_SLOTS, "{roomy}");
    assert!(!ring.clipping && bf16.clipping);
    assert!(ring.effect.starts_with("no clipping") && bf16.effect.contains("bf16"));
    // A schedule without a ring is not offered one.
    let no_ring = PlanInput {
        supports: Capabilities { gradient_ring: false, ..Capabilities::ALL },
        ..input.clone()
    };
    let tiers: Vec<_> =
        gradient_options(&no_ring).expect("valid").iter().map(|o| o.gradients).collect();
    assert!(!tiers.contains(&GradientTier::HostRing), "{tiers:?}");
}

#[test]
fn seventy_b_class_fits_one_h200_with_1_5_tb_at_about_12_host_bytes_per_parameter() {
    // The paper's machine: one H200 and 1.5 TB of host memory. The weights stream from the
    // fp32 master (no bf16 copy), the gradients wait on the device or land in a ring.
    let machine = (139 * GIB, 1536 * GIB);
    for (name, shape) in [("llama3-70b", &LLAMA70), ("qwen2.5-72b", &QWEN72)] {
        for clipping in [true, false] {
            let plan = fits(check(name, (1024, 8, 8), machine, clipping));
            assert_eq!(plan.placement.weights, WeightSource::Master, "{name}\n{plan}");
            let per_param = plan.budget.host_used() as f64 / shape.params() as f64;
            // 12 for master, m and v; the rest is the ring or gradient store and staging.
            assert!(per_param >= 12.0, "{name}: {per_param:.2}");
            let most =
                if plan.placement.gradients == GradientTier::HostStore { 16.1 } else { 12.5 };
            assert!(per_param <= most, "{name} clipping {clipping}: {per_param:.2}\n{plan}");
        }
    }
}

/// Host bytes by hand: 12 per parameter (fp32 master, m and v) and, unless the weights stream
/// from the master, a 2-byte bf16 copy; plus the gradient ring (four slots of the largest unit
/// in fp32: the untied head, its norm and LM head) or the 4-byte gradient store, token staging
/// (4 i32 arrays per token and one bound per micro-batch) and one 4 KiB alignment page per unit
/// per array (4 arrays with a copy, 3 without). The master is pinned when the weights stream
/// from it.
fn host_by_hand(s: &Shape, grads_on_host: bool, tokens: u64, g: u64, master: bool) -> (u64, u64) {
    let p = s.params();
    let units = s.layers + 2;
    let grads = if grads_on_host { 4 * p } else { 4 * (s.vocab * s.hidden + s.hidden) * 4 };
    let (source, arrays) = if master { (4 * p, 2) } else { (2 * p, 3) };
    let pinned = source + grads + tokens * 16 + g * 4 + units * 4096;
    let pageable = (if master { 8 } else { 12 }) * p + arrays * units * 4096;
    (pinned, pageable)
}

#[test]
fn seven_and_eight_b_fit_the_h200_machine_with_budgets_as_computed_by_hand() {
    for (name, shape) in [("qwen2.5-7b", &QWEN7), ("llama3-8b", &LLAMA8)] {
        let plan = fits(check(name, (1024, 8, 8), H200, true));
        let p = shape.params();
        assert_eq!(plan.model.params, p, "{name}");
        let (t, g, h) = (8 * 1024u64, 8u64, shape.hidden);
        let b = &plan.budget;

        // Host: 12 bytes per parameter plus the stated extras, exactly. Every unit is
        // resident, so weights cross PCIe once per step: room for fp32, no bf16 copy.
        assert_eq!(plan.placement.weights, WeightSource::Master, "{name}\n{plan}");
        assert!(plan.placement.weights_reason.contains("PCIe has room"), "{plan}");
        let on_host = plan.placement.gradients == GradientTier::HostStore;
        let (pinned, pageable) = host_by_hand(shape, on_host, g * t, g, true);
        assert_eq!(b.pinned_host.used, pinned, "{name} pinned\n{plan}");
        assert_eq!(b.pageable_host.used, pageable, "{name} pageable\n{plan}");
        assert_eq!(b.host_used(), pinned + pageable);
        assert!(b.host_used() <= 125 * GIB);

        // Device: with 139 GiB every unit stays resident. The gradients wait in whichever
        // fp32 store gives the faster step once each leaves its spare memory to kept
        // activations: the host store frees 4 bytes a parameter of the device for them.
        assert_eq!(plan.placement.streamed_units, 0, "{name}\n{plan}");
        assert_eq!(plan.placement.gradients, GradientTier::HostStore, "{name}\n{plan}");
        assert_eq!(plan.placement.checkpoints, CheckpointTier::Device, "{name}");
        assert_eq!(plan.placement.checkpoint_interval, 1, "{name}");
        let scratch = t * (5 * h + 2 * shape.qkv() + 2 * shape.att() + 6 * shape.inter) * 2
            + t * (2 + 2 * shape.q_heads) * 4;
        // One chunk of logits: 2^28 of them over the vocabulary, f32 plus their bf16 gradient.
        let head = 2 * t * h * 2 + 3 * t * 4 + ((1 << 28) / shape.vocab) * shape.vocab * 6;
        let device = 2 * p // resident bf16 weights
            + if on_host { 2 * 4 * (shape.vocab * h + h) } else { 4 * p } // accumulators or store
            + scratch
            + head
            + 2 * g * t * h * 2 // activations in and out
            + (shape.layers + 1) * g * t * h * 2 // checkpoints
            + g * t * 16 + g * 4 // token batches
            + 4 * (shape.vocab * shape.hidden + shape.hidden).min(CAST_CHUNK as u64) // staging
            + 9 * GIB / 4 + 8 * t * h; // runtime reserve: fixed, and temporaries per token
        // What the device has left keeps whole layers' activations (their forward state for
        // every micro-batch but the norms' outputs and the activation, derived again), as many
        // as fit, so their backward skips the recompute.
        let buf = |bytes: u64| bytes.next_multiple_of(2 << 20);
        let bf16 = [h, shape.qkv(), shape.att(), 2 * shape.inter];
        let per_layer =
            g * (bf16.iter().map(|&e| buf(t * e * 2)).sum::<u64>() + buf(t * shape.q_heads * 4));
        let kept = plan.placement.kept_layers.len() as u64;
        assert!(
            kept > 0,
            "{name}: room for kept activations
{plan}"
        );
        assert_eq!(b.device.part("kept activations"), kept * per_layer, "{name}");
        // At rows of 1,024 tokens a whole layer spares far more than attention outputs: as
        // many as fit are kept.
        assert!(device + (kept + 1) * per_layer > 139 * GIB, "{name}: one more would fit");
        // What whole layers leave keeps other layers' attention outputs (output and
        // log-sum-exp), so their recompute skips the attention: no memory is left that would
        // hold one more set.
        let per_attention = g * (buf(t * shape.att() * 2) + buf(t * shape.q_heads * 4));
        let attention = plan.placement.kept_attention_layers.len() as u64;
        assert_eq!(b.device.part("kept attention outputs"), attention * per_attention, "{name}");
        let device = device + kept * per_layer + attention * per_attention;
        assert!(
            device + per_attention > 139 * GIB || kept + attention == shape.layers,
            "{name}: one more attention output fits"
        );
        assert_eq!(b.device.part("layer scratch"), scratch, "{name}");
        assert_eq!(b.device.part("checkpoints"), (shape.layers + 1) * g * t * h * 2, "{name}");
        assert_eq!(b.device.used, device, "{name}\n{plan}");
        assert_eq!(b.device.part("weight slots"), 0, "nothing streams: no slots");
    }
}

#[test]
fn long_rows_keep_attention_outputs_where_whole_layers_do_not_fit() {
    // At 2 x 32,768 tokens a whole layer's activations take 4.6 GiB a micro-batch, its
    // attention output 0.23 GiB, and the attention is most of the recompute: the planner gives
    // up whole layers for attention outputs of every other layer, and prices each recompute
    // without its attention.
    let plan = fits(check("qwen2.5-7b", (32768, 1, 2), H200, true));
    let p = &plan.placement;
    let (kept, attention) = (p.kept_layers.len(), p.kept_attention_layers.len());
    assert!(kept > 0 && attention > 0, "{plan}");
    assert!(p.kept_attention_layers.iter().all(|l| !p.kept_layers.contains(l)), "{plan}");
    assert_eq!(kept + attention, QWEN7.layers as usize, "every layer keeps something\n{plan}");
    let b = &plan.budget;
    let buf = |bytes: u64| bytes.next_multiple_of(2 << 20);
    let per_attention = 2 * (buf(32768 * QWEN7.att() * 2) + buf(32768 * QWEN7.q_heads * 4));
    assert_eq!(b.device.part("kept attention outputs"), attention as u64 * per_attention);
    assert!(b.device.used <= 139 * GIB, "{plan}");
    // Per layer a forward attention and a backward (2.5 forwards' FLOPs at the backward's
    // rate); no recompute runs one.
    let pairs = 32768.0 * 32769.0 / 2.0;
    let per_layer = 2.0 * pairs * 4.0 * (QWEN7.head_dim * QWEN7.q_heads) as f64;
    let rates = MachineRates::default();
    let layer = per_layer / rates.attention_forward_rate(32768)
        + 2.5 * per_layer / rates.attention_backward_rate(32768);
    let want = (kept + attention) as f64 * layer;
    assert!((plan.time.attention_s - want).abs() < 1e-9 * want, "{:?}", plan.time);
}

#[test]
fn fourteen_b_needs_more_host_than_the_h200_machine_has_and_fits_with_it() {
    // 12 x 14.77e9 = 177.2 GB = 165.1 GiB of training state alone: more than 125 GiB.
    let r = refused(check("qwen2.5-14b", (1024, 8, 8), H200, true));
    assert_eq!(r.overflows.len(), 1, "{r}");
    assert_eq!(r.overflows[0].memory, Memory::Host);
    let (pinned, pageable) = host_by_hand(&QWEN14, false, 8 * 8 * 1024, 8, true);
    assert_eq!(r.overflows[0].needed, pinned + pageable, "{r}");
    assert_eq!(r.overflows[0].over_by, pinned + pageable - 125 * GIB);
    assert!(r.fits.contains(&Suggestion::HostMemory(pinned + pageable)), "{r}");
    assert!(r.reason.contains("host memory"), "{}", r.reason);

    // With that much host RAM it fits, and its budget is still 12 bytes/param plus extras.
    let plan = fits(check("qwen2.5-14b", (1024, 8, 8), (139 * GIB, pinned + pageable), true));
    assert_eq!(plan.budget.host_used(), pinned + pageable);
    assert!(plan.placement.resident_units.len() > 1, "{plan}");
}

#[test]
fn seventy_two_b_is_refused_for_host_memory_with_what_it_needs() {
    let r = refused(check("qwen2.5-72b", (1024, 8, 8), H200, true));
    let p = QWEN72.params();
    assert!(12 * p > 125 * GIB, "the premise: 12 bytes/param exceeds the host");
    let host = r.overflows.iter().find(|o| o.memory == Memory::Host).expect("host overflows");
    // The leanest host placement keeps gradients on the device (a four-slot ring on the host),
    // but 4 bytes/param of gradients (291 GB) do not fit 139 GiB, so RAM for a host store is
    // what it takes: the least of it with the store in bf16 (2 bytes per parameter less).
    let (lean_pinned, lean_pageable) = host_by_hand(&QWEN72, false, 8 * 8 * 1024, 8, true);
    assert_eq!(host.needed, lean_pinned + lean_pageable);
    assert_eq!(host.over_by, lean_pinned + lean_pageable - 125 * GIB);
    let (pinned, pageable) = host_by_hand(&QWEN72, true, 8 * 8 * 1024, 8, true);
    let bf16_store = pinned + pageable - 2 * p;
    assert!(r.fits.contains(&Suggestion::HostMemory(bf16_store)), "{:?}", r.fits);
    let text = r.to_string();
    assert!(text.contains("host memory") && text.contains("over by"), "{text}");
    // No batch change rescues it.
    assert!(!r.fits.iter().any(|s| matches!(s, Suggestion::MicroBatch(_))), "{text}");
}

#[test]
fn tight_gpu_streams_the_rest_through_two_slots() {
    // 110 GiB of host memory holds the gradient ring but not a gradient store: the gradients
    // wait on the device, and what room is left keeps some units resident.
    let plan = fits(check("qwen2.5-7b", (1024, 8, 8), (40 * GIB, 110 * GIB), true));
    let pl = &plan.placement;
    assert!(pl.streamed_units > 0 && !pl.resident_units.is_empty(), "{plan}");
    // The embedding is resident before any layer (same saving per byte, larger unit); the head
    // saves no traffic and only takes what room is left.
    assert!(pl.resident_units.contains(&0), "{plan}");
    // The slots hold the largest streamed unit: the untied head (norm + LM head).
    let head = QWEN7.hidden + QWEN7.vocab * QWEN7.hidden;
    let largest_layer = QWEN7.layer();
    let streamed_head = !pl.resident_units.contains(&(QWEN7.layers as usize + 1));
    let slot = if streamed_head { head } else { largest_layer };
    assert_eq!(plan.budget.device.part("weight slots"), 2 * 2 * slot, "{plan}");
    assert!(plan.budget.device.used <= 40 * GIB);
}

#[test]
fn pcie_traffic_by_hand_and_independent_of_grad_accum() {
    // Clipping off at 40 GiB: streamed units go up twice (layers, embedding) or once (head),
    // resident ones once; every gradient comes down once.
    let p = QWEN7.params();
    for g in [1, 4] {
        let plan = fits(check("qwen2.5-7b", (1024, 4, g), (40 * GIB, 125 * GIB), false));
        let pl = &plan.placement;
        assert_eq!(pl.gradients, GradientTier::HostRing);
        assert_eq!(pl.optimizer, OptimizerMode::AsGradientsLand);
        let head_unit = QWEN7.layers as usize + 1;
        let unit_params = |u: usize| match u {
            0 => QWEN7.vocab * QWEN7.hidden,
            u if u == head_unit => QWEN7.hidden + QWEN7.vocab * QWEN7.hidden,
            _ => QWEN7.layer(),
        };
        let h2d: u64 = (0..=head_unit)
            .map(|u| {
                let visits = if pl.resident_units.contains(&u) || u == head_unit { 1 } else { 2 };
                visits * pl.weights.bytes() * unit_params(u)
            })
            .sum();
        assert_eq!(plan.time.h2d_bytes, h2d, "G = {g}\n{plan}");
        assert_eq!(plan.time.d2h_bytes, 4 * p, "G = {g}");
    }
}

#[test]
fn long_context_moves_checkpoints_to_the_host() {
    // A machine with less GPU memory and plenty of RAM: 32k-token rows, 16 micro-batches.
    let mem = (80 * GIB, 500 * GIB);
    let short = fits(check("qwen2.5-7b", (1024, 1, 16), mem, true));
    assert_eq!(short.placement.checkpoints, CheckpointTier::Device, "{short}");
    let long = fits(check("qwen2.5-7b", (32768, 1, 16), mem, true));
    assert_eq!(long.placement.checkpoints, CheckpointTier::Host, "{long}");
    let ckpt = (QWEN7.layers + 1) * 16 * 32768 * QWEN7.hidden * 2;
    assert_eq!(long.budget.pinned_host.part("checkpoints"), ckpt, "{long}");
    assert_eq!(long.budget.device.part("checkpoints"), 0);
    // They go down once and come back once (the head's input is used where it is made).
    assert!(long.time.h2d_bytes >= ckpt - 16 * 32768 * QWEN7.hidden * 2);

    // On the H200 machine the host has no room for them: the device keeps them, which it can
    // with every layer's input once the gradients wait in the host store (the master as the
    // weights' source leaves the host room for it).
    let h200 = fits(check("qwen2.5-7b", (32768, 1, 16), H200, true));
    assert_eq!(h200.placement.checkpoints, CheckpointTier::Device, "{h200}");
    assert_eq!(
        (h200.placement.gradients, h200.placement.weights),
        (GradientTier::HostStore, WeightSource::Master),
        "{h200}"
    );
    // Without the master as a source that store does not fit: every K-th input instead.
    let copy = Capabilities { master_streaming: false, ..Capabilities::ALL };
    let memory = MachineMemory::given(H200.0, H200.1);
    let h200 = fits(plan_with("qwen2.5-7b", (32768, 1, 16), memory, copy));
    assert_eq!(h200.placement.checkpoints, CheckpointTier::Device, "{h200}");
    assert!(h200.placement.checkpoint_interval > 1, "{h200}");
}

#[test]
fn bottleneck_moves_to_compute_as_tokens_per_step_grow() {
    // A 7B model fully resident moves 2 bytes/param up and 4 down per step (0.30 s + 0.61 s at
    // 50 GB/s) while the CPU AdamW takes 1.52 s at 5 Gparam/s: with few tokens per step the
    // optimizer is the busiest resource on the H200 machine.
    let small = fits(check("qwen2.5-7b", (1024, 1, 1), H200, true));
    assert_eq!(small.time.bottleneck, Bottleneck::CpuAdam, "{small}");
    let large = fits(check("qwen2.5-7b", (1024, 8, 8), H200, true));
    assert_eq!(large.time.bottleneck, Bottleneck::GpuCompute, "{large}");
    // The same weights cross PCIe either way: traffic does not grow with the batch (only with
    // the weights' source: bf16 where the short step is bound by what crosses, fp32 where
    // compute hides it).
    assert_eq!(
        small.time.h2d_bytes / small.placement.weights.bytes(),
        large.time.h2d_bytes / large.placement.weights.bytes()
    );
    assert!(large.time.tokens_per_s > 10.0 * small.time.tokens_per_s);

    // With a CPU four times faster and a GPU too small to keep units resident, PCIe is the
    // limit for short steps, and compute again for long ones.
    let spec = preset("qwen2.5-7b").expect("preset");
    let run = |micro_batch, grad_accum| {
        let input = PlanInput {
            spec: &spec,
            batch: BatchShape { seq_len: 1024, micro_batch, grad_accum },
            clipping: false,
            memory: MachineMemory::given(24 * GIB, H200.1),
            rates: MachineRates { adam_params: 20e9, ..MachineRates::default() },
            supports: Capabilities::ALL,
            gpus: 1,
        };
        fits(plan(&input).expect("valid"))
    };
    let small = run(1, 1);
    assert_eq!(small.time.bottleneck, Bottleneck::Pcie, "{small}");
    let large = run(4, 16);
    assert_eq!(large.time.bottleneck, Bottleneck::GpuCompute, "{large}");
}

#[test]
fn compute_time_is_six_flops_per_gemm_parameter_per_token_plus_recompute_and_attention() {
    let plan = fits(check("qwen2.5-7b", (4096, 2, 4), H200, true));
    let n = (4096 * 2 * 4) as f64;
    let s = &QWEN7;
    let rates = MachineRates::default();
    // Forward and backward: 6 FLOPs per GEMM parameter and token. The recompute before a
    // layer's backward 2 more per parameter of all but the down projection, whose output the
    // backward does not read.
    let layer = (s.qkv() + s.att() + 3 * s.inter) * s.hidden;
    let recomputed = (s.qkv() + s.att() + 2 * s.inter) * s.hidden;
    // Layers whose activations are kept skip the recompute: 3.5 forward attentions, the
    // forward's elementwise bytes once.
    let kept = plan.placement.kept_layers.len() as f64;
    // Layers whose attention output is kept skip only the recompute's attention.
    let kept_attention = plan.placement.kept_attention_layers.len() as f64;
    let layers = s.layers as f64;
    let flops = 6.0 * layers * layer as f64 + 2.0 * (layers - kept) * recomputed as f64;
    let gemm = flops * n / 700e12;
    // The LM head: forward and backward, each chunk's logits computed once, at its own rate.
    let head = 6.0 * (s.vocab * s.hidden) as f64 * n / rates.head_flops;
    // Causal: 4096 * 4097 / 2 query-key pairs per row, 4 hd FLOPs per head per pair forward;
    // forward and recompute at the forward's rate, 2.5 x forward for the backward at its own.
    let pairs = 4096.0 * 4097.0 / 2.0;
    let forward = 8.0 * pairs * 4.0 * (s.head_dim * s.q_heads) as f64;
    let forwards = 2.0 * (layers - kept - kept_attention) + kept + kept_attention;
    let attn = forwards * forward / rates.attention_forward_rate(4096)
        + layers * 2.5 * forward / rates.attention_backward_rate(4096);
    // Elementwise bf16 bytes per token and layer: forward two norms (2 H each), RoPE on q and
    // k (read and write), the gated activation (3 I), and the residual each of the two
    // projections reads as its GEMM's C (H each; the q/k/v bias is the GEMM's epilogue);
    // backward 3 H per norm, the bias read once, RoPE, 5 I, and the residual's gradient each
    // norm's backward adds (H each). The forward runs twice (the recompute); a kept layer
    // instead runs its two norms and its activation again (4 H + 3 I).
    let (h, i, qkv) = (s.hidden as f64, s.inter as f64, s.qkv() as f64);
    let rotated = ((s.q_heads + s.kv_heads) * s.head_dim) as f64;
    let fwd = 4.0 * h + 2.0 * rotated + 3.0 * i + 2.0 * h;
    let bwd = 6.0 * h + qkv + 2.0 * rotated + 5.0 * i + 2.0 * h;
    let rederive = 4.0 * h + 3.0 * i;
    let elementwise =
        ((layers - kept) * (2.0 * fwd + bwd) + kept * (fwd + rederive + bwd)) * 2.0 * n
            / rates.elementwise_bytes;
    let t = &plan.time;
    let close = |a: f64, b: f64| (a - b).abs() < 1e-9 * b;
    assert!(close(t.gemm_s, gemm), "{} vs {gemm}", t.gemm_s);
    assert!(close(t.head_s, head), "{} vs {head}", t.head_s);
    assert!(close(t.attention_s, attn), "{} vs {attn}", t.attention_s);
    assert!(close(t.elementwise_s, elementwise), "{} vs {elementwise}", t.elementwise_s);
    assert!(close(t.compute_s, gemm + head + attn + elementwise), "{t:?}");
    // The step can't beat its busiest resource, and the optimizer splits into hidden + exposed.
    assert!(t.total_s >= t.compute_s.max(t.h2d_s).max(t.d2h_s).max(t.adam_s) - 1e-9);
    assert!((t.adam_hidden_s + t.adam_exposed_s - t.adam_s).abs() < 1e-9);
    assert!((t.adam_s - s.params() as f64 / 5e9).abs() < 1e-9);
}

#[test]
fn a_micro_batch_too_large_for_the_device_is_refused_with_the_largest_that_fits() {
    let r = refused(check("qwen2.5-7b", (32768, 16, 8), H200, true));
    assert_eq!(r.overflows[0].memory, Memory::Device, "{r}");
    let m = r
        .fits
        .iter()
        .find_map(|s| if let Suggestion::MicroBatch(m) = s { Some(*m) } else { None })
        .expect("a micro-batch that fits");
    fits(check("qwen2.5-7b", (32768, m, 8), H200, true));
    refused(check("qwen2.5-7b", (32768, m + 1, 8), H200, true));
    assert!(r.to_string().contains(&format!("--micro-batch {m}")), "{r}");
}

#[test]
fn invalid_input_is_an_error() {
    let spec = preset("qwen2.5-7b").expect("preset");
    let mut input = PlanInput {
        spec: &spec,
        batch: BatchShape { seq_len: 0, micro_batch: 1, grad_accum: 1 },
        clipping: true,
        memory: MachineMemory::given(H200.0, H200.1),
        rates: MachineRates::default(),
        supports: Capabilities::ALL,
        gpus: 1,
    };
    let err = plan(&input).expect_err("seq_len 0");
    assert!(err.to_string().contains("seq_len"), "{err}");
    input.batch.seq_len = 1 << 20;
    let err = plan(&input).expect_err("too long");
    assert!(err.to_string().contains("max_position_embeddings 32768"), "{err}");
    input.batch.seq_len = 1024;
    input.rates.pcie_h2d = f64::NAN;
    let err = plan(&input).expect_err("NaN rate");
    assert!(err.to_string().contains("pcie_h2d"), "{err}");
}

#[test]
fn verdict_serialises_for_the_web_form_and_refusal_becomes_an_error() {
    let json = serde_json::to_value(check("qwen2.5-7b", (1024, 8, 8), H200, true)).expect("json");
    assert_eq!(json["verdict"], "fits");
    assert_eq!(json["placement"]["checkpoints"], "device");
    assert_eq!(json["budget"]["device"]["tier"], "device");
    assert!(json["time"]["total_s"].as_f64().is_some_and(|t| t > 0.0));
    let v = check("qwen2.5-72b", (1024, 8, 8), H200, true);
    assert_eq!(serde_json::to_value(&v).expect("json")["verdict"], "refused");
    let err = v.into_plan().expect_err("refused");
    assert!(err.to_string().contains("does not fit: host memory"), "{err}");
}

fn plan_with(
    name: &str,
    batch: (usize, usize, usize),
    memory: MachineMemory,
    caps: Capabilities,
) -> Verdict {
    let spec = preset(name).expect("preset");
    let (seq_len, micro_batch, grad_accum) = batch;
    let input = PlanInput {
        spec: &spec,
        batch: BatchShape { seq_len, micro_batch, grad_accum },
        clipping: true,
        memory,
        rates: MachineRates::default(),
        supports: caps,
        gpus: 1,
    };
    plan(&input).expect("valid input")
}

#[test]
fn only_placements_the_schedule_implements_are_offered() {
    // Without a device gradient store the gradients wait in the host store: 18 bytes per
    // parameter on the host, 137 GB for Qwen2.5-7B, more than the machine's 125 GiB.
    let host_only_grads = Capabilities {
        max_checkpoint_interval: 1,
        device_gradient_store: false,
        gradient_ring: false,
        bf16_gradient_store: false,
        master_streaming: false,
        only_gradients: None,
        disk_moments: false,
        moments: MomentsPolicy::Auto,
        keep_activations: false,
    };
    let memory = MachineMemory::given(H200.0, H200.1);
    let r = refused(plan_with("qwen2.5-7b", (1024, 8, 8), memory.clone(), host_only_grads));
    assert_eq!(r.overflows[0].memory, Memory::Host, "{r}");
    // Streaming from the master drops the bf16 copy: 16 bytes per parameter, 122 GB, fits.
    let from_master = Capabilities { master_streaming: true, ..host_only_grads };
    let p = fits(plan_with("qwen2.5-7b", (1024, 8, 8), memory.clone(), from_master));
    assert_eq!(
        (p.placement.gradients, p.placement.weights),
        (GradientTier::HostStore, WeightSource::Master),
        "{p}"
    );
    assert!(p.placement.weights_reason.contains("would not fit"), "{p}");
    // With a device store offered and no kept activations to spend the device on, gradients
    // wait on the device (as fast, and the simpler placement).
    let all = Capabilities { keep_activations: false, ..Capabilities::ALL };
    let all = fits(plan_with("qwen2.5-7b", (1024, 8, 8), memory.clone(), all));
    assert_eq!(all.placement.gradients, GradientTier::DeviceStore, "{all}");

    let p = fits(plan_with("qwen2.5-3b", (1024, 8, 8), memory, host_only_grads));
    assert_eq!(p.placement.gradients, GradientTier::HostStore, "{p}");
    // Where device memory is short, K > 1 is not offered: host checkpoints instead.
    let small_gpu = MachineMemory::given(24 * GIB, H200.1);
    let p = fits(plan_with("qwen2.5-3b", (4096, 4, 8), small_gpu, host_only_grads));
    assert_eq!(p.placement.checkpoint_interval, 1, "{p}");
}

#[test]
fn on_the_cpu_one_memory_holds_the_state_and_the_buffers() {
    let host = |bytes| MachineMemory::detect(GpuQuery::HostOnly, None, Some(bytes)).expect("given");
    let p = fits(plan_with("tiny", (128, 4, 1), host(GIB), Capabilities::ALL));
    // Nothing is resident (it would be a second copy in the same memory), checkpoints stay in
    // the backend's own buffers, and both tiers together fit the one memory.
    assert!(p.placement.resident_units.is_empty(), "{p}");
    assert_eq!(p.placement.checkpoints, CheckpointTier::Device, "{p}");
    assert!(p.budget.device.used + p.budget.host_used() <= GIB, "{p}");

    // A refusal names the least memory any placement needs; with exactly that it fits.
    let r = refused(plan_with("tiny", (128, 4, 1), host(1 << 20), Capabilities::ALL));
    assert_eq!(r.overflows.len(), 1, "{r}");
    assert_eq!(r.overflows[0].memory, Memory::Host, "{r}");
    let need = r.overflows[0].needed;
    assert!(need <= p.budget.device.used + p.budget.host_used(), "{r}");
    assert!(r.to_string().contains("host memory (the CPU backend"), "{r}");
    assert!(r.fits.contains(&Suggestion::HostMemory(need)), "{r}");
    assert!(!r.fits.iter().any(|s| matches!(s, Suggestion::GpuMemory(_))), "{r}");
    let p = fits(plan_with("tiny", (128, 4, 1), host(need), Capabilities::ALL));
    assert_eq!(p.budget.device.used + p.budget.host_used(), need, "{p}");
    refused(plan_with("tiny", (128, 4, 1), host(need - 1), Capabilities::ALL));
}

/// Qwen2.5-7B, 16 micro-batches of 4096 tokens, on 1, 2 and 4 H200s. Two GPUs halve the compute
/// (7.0 s to 3.5 s) and each link gets a quarter of the host's 120 GB/s of memory traffic (30 GB/s
/// each way), but the one CPU AdamW (1.5 s a step whatever the GPU count) no longer hides behind
/// the shorter step and the all-reduce adds 0.3 s: about 1.6x. Four GPUs get 15 GB/s each and the
/// step becomes PCIe-bound: about 1.9x. Host bandwidth and the CPU optimizer, not the GPUs, bound
/// data parallelism on one host.
#[test]
fn several_gpus_share_the_step_and_the_host_memory_bandwidth() {
    let spec = preset("qwen2.5-7b").expect("preset");
    let input = |gpus| PlanInput {
        spec: &spec,
        batch: BatchShape { seq_len: 4096, micro_batch: 1, grad_accum: 16 },
        clipping: true,
        memory: MachineMemory::given(H200.0, H200.1),
        rates: MachineRates::default(),
        supports: Capabilities::ALL,
        gpus,
    };
    let one = fits(plan(&input(1)).expect("valid"));
    assert!(one.parallel.is_none());
    let two = fits(plan(&input(2)).expect("valid"));
    let four = fits(plan(&input(4)).expect("valid"));
    let (p2, p4) = (two.parallel.clone().expect("2 GPUs"), four.parallel.clone().expect("4 GPUs"));
    assert_eq!((p2.micro_batches_per_gpu, p4.micro_batches_per_gpu), (8, 4));
    assert!((p2.link_bytes_per_s - 30e9).abs() < 1.0, "{}", p2.link_bytes_per_s);
    assert!((p4.link_bytes_per_s - 15e9).abs() < 1.0, "{}", p4.link_bytes_per_s);
    assert_eq!(p2.one_gpu_step_s, Some(one.time.total_s));
    assert_eq!(two.tokens_per_step, one.tokens_per_step);
    // The all-reduce: 2 (N - 1) / N of 4 bytes per parameter at the assumed bus bandwidth.
    let want = 4.0 * one.model.params as f64 / ALLREDUCE_BUS_BYTES;
    assert!((p2.allreduce_s - want).abs() < 1e-9, "{} vs {want}", p2.allreduce_s);
    let (s2, s4) = (p2.speedup.expect("fits one GPU"), p4.speedup.expect("fits one GPU"));
    assert!(s2 > 1.5 && s2 < 1.75, "2 GPUs: {s2}");
    assert!(s4 > s2 && s4 < 2.1, "4 GPUs: {s4}");
    assert!(two.time.adam_exposed_s > one.time.adam_exposed_s);
    assert_eq!(four.time.bottleneck, Bottleneck::Pcie);
    assert!(two.to_string().contains("speed-up over one GPU"), "{two}");

    let err = plan(&input(0)).expect_err("no GPU");
    assert!(err.to_string().contains("at least one GPU"), "{err}");
    let err = plan(&input(32)).expect_err("more GPUs than micro-batches");
    assert!(err.to_string().contains("at least 32 micro-batches"), "{err}");
}

#[test]
fn shapes_beyond_the_engines_ceilings_are_refused_before_any_arithmetic() {
    let spec = preset("qwen2.5-7b").expect("preset");
    let cases = [
        ((1024, 8, 1_000_000_000), "grad_accum must be between 1 and 65536"),
        ((1024, 1 << 56, 8), "micro_batch must be between 1 and 4096"),
        ((1 << 40, 1, 1), "seq_len must be between 1 and 1048576"),
        ((1 << 20, 4096, 1), "seq_len x micro_batch must be at most 16777216 tokens"),
        ((0, 1, 1), "seq_len must be between 1"),
    ];
    for ((seq_len, micro_batch, grad_accum), want) in cases {
        for gpus in [1, 2] {
            let input = PlanInput {
                spec: &spec,
                batch: BatchShape { seq_len, micro_batch, grad_accum },
                clipping: true,
                memory: MachineMemory::given(H200.0, H200.1),
                rates: MachineRates::default(),
                supports: Capabilities::ALL,
                gpus,
            };
            let err = plan(&input).expect_err(want);
            assert!(err.to_string().contains(want), "{gpus} GPU(s): {err}");
        }
    }
}

#[test]
fn soft_capped_attention_is_priced_at_the_scalar_kernels_rate() {
    // Gemma 2's soft-capped attention runs on the scalar kernels: the same FLOPs at
    // `scalar_attention_flops`; its GEMMs cost what any model's do.
    let capped = preset("gemma-2-9b").expect("preset");
    let mut uncapped = capped.clone();
    uncapped.attn_softcap = None;
    let time = |spec: &ModelSpec| {
        let input = PlanInput {
            spec,
            batch: BatchShape { seq_len: 1024, micro_batch: 8, grad_accum: 8 },
            clipping: true,
            memory: MachineMemory::given(139 * GIB, 251 * GIB),
            rates: MachineRates::default(),
            supports: Capabilities::ALL,
            gpus: 1,
        };
        let plan = fits(plan(&input).expect("valid"));
        // Forward attentions per step: 2 a layer, 1 where the recompute skips it.
        let spared = plan.placement.kept_layers.len() + plan.placement.kept_attention_layers.len();
        let forwards = 2.0 * spec.layers as f64 - spared as f64;
        (plan.time, forwards, plan.placement.kept_layers.len())
    };
    let ((c, c_fwd, c_kept), (u, u_fwd, u_kept)) = (time(&capped), time(&uncapped));
    // The same forward FLOPs per layer behind both times: capped at the scalar rate both ways,
    // uncapped at the tensor-core kernels' forward and backward rates (the backward 2.5
    // forwards).
    let (rates, layers) = (MachineRates::default(), capped.layers as f64);
    let f_capped = c.attention_s * rates.scalar_attention_flops / (c_fwd + 2.5 * layers);
    let f_uncapped = u.attention_s
        / (u_fwd / rates.attention_forward_rate(1024)
            + 2.5 * layers / rates.attention_backward_rate(1024));
    assert!((f_capped - f_uncapped).abs() < 1e-9 * f_uncapped, "{c:?} vs {u:?}");
    if c_kept == u_kept {
        assert!((c.gemm_s - u.gemm_s).abs() < 1e-12);
    }
}

#[test]
fn gpt_oss_120b_fits_one_h200_with_1_5_tb_counting_every_expert() {
    // The paper's headline: gpt-oss-120b (116.8B parameters, 128 experts a layer) on one H200
    // with 1.5 TB of host memory. Every expert's master, moments and gradient are held: at 12
    // bytes per parameter plus a ring without clipping, and with exact clipping only by keeping
    // the gradients in bf16 (fp32 on the host would need 16 bytes a parameter, 1.74 TiB; on
    // the device 452 GiB).
    let machine = (139 * GIB, 1536 * GIB);
    let params = 116_829_156_672f64;
    let plan = fits(check("gpt-oss-120b", (1024, 8, 1), machine, false));
    let per_param = plan.budget.host_used() as f64 / params;
    assert!((12.0..=12.5).contains(&per_param), "{per_param:.2}\n{plan}");
    let plan = fits(check("gpt-oss-120b", (1024, 8, 1), machine, true));
    assert_eq!(plan.placement.gradients, GradientTier::HostStoreBf16, "{plan}");
    let per_param = plan.budget.host_used() as f64 / params;
    assert!((14.0..=14.1).contains(&per_param), "{per_param:.2}\n{plan}");

    // Compute counts each token's 4 experts and the router, not all 128: per layer q, k, v, o
    // ((64 + 2 x 8) x 64 + 64 x 64 rows of 2880) and 4 x 3 x 2880 x 2880 + 128 x 2880, 8 FLOPs
    // per GEMM parameter per token with the recompute, then the LM head (201088 x 2880) at its
    // own rate, 6 FLOPs per parameter per token (no recompute: its logits are computed once).
    let (h, layers) = (2880.0, 36.0);
    let layer = ((64.0 + 16.0) * 64.0 + 64.0 * 64.0) * h + 4.0 * 3.0 * h * h + 128.0 * h;
    let gemm = 8.0 * layers * layer * 8192.0 / 700e12;
    assert!((plan.time.gemm_s - gemm).abs() < 1e-9 * gemm, "{} vs {gemm}", plan.time.gemm_s);
    let head = 6.0 * 201088.0 * h * 8192.0 / MachineRates::default().head_flops;
    assert!((plan.time.head_s - head).abs() < 1e-9 * head, "{} vs {head}", plan.time.head_s);
}

#[test]
fn a_moe_layers_scratch_holds_its_routed_rows() {
    // Mixtral: 8192 tokens a micro-batch, each routed to 2 of 8 experts (14336 wide): the
    // expert activations are 16384 rows whatever the router's counts.
    let spec = preset("mixtral-8x7b").expect("preset");
    let dense = {
        let mut s = spec.clone();
        s.moe = None;
        sizes::layer_scratch_bytes(&s, 8192)
    };
    let (t, k, e, h, i) = (8192u64, 2u64, 8u64, 4096u64, 14336u64);
    let moe = t * (e * 2 + (2 * e + 2 * k) * 4) + t * k * (3 * 4 + (4 * h + 6 * i) * 2);
    // Every layer is a mixture: no dense MLP buffers (6 x 14336 bf16 per token) either.
    let dense_mlp = t * 6 * i * 2;
    assert_eq!(sizes::layer_scratch_bytes(&spec, 8192), dense - dense_mlp + moe);
}

#[test]
fn the_fused_attention_backwards_sums_count_only_beyond_the_heads_logits_chunk() {
    // Qwen2.5-7B: q/k/v 4608 wide, vocabulary 152064. The head's chunk is 1 GiB of f32 logits
    // (1765 tokens) and their bf16 gradient: 1.61 GB of pool the sums reuse.
    let spec = preset("qwen2.5-7b").expect("preset");
    let chunk = crate::placement::LOSS_CHUNK_LOGITS as u64 / 152064;
    let logits = chunk * 152064 * 6;
    // 8,192 and 32,768 tokens: 151 MB and 604 MB of sums, inside that pool.
    assert_eq!(sizes::attention_sums_bytes(&spec, 8192, chunk), 0);
    assert_eq!(sizes::attention_sums_bytes(&spec, 32768, chunk), 0);
    // 131,072 tokens (4 rows of 32,768): 2.42 GB, of which the part beyond the logits is new.
    assert_eq!(sizes::attention_sums_bytes(&spec, 131072, chunk), 131072 * 4608 * 4 - logits);
    let long = fits(check("qwen2.5-7b", (32768, 4, 1), (H200.0, 1 << 40), true));
    let part = long.budget.device.parts.iter().find(|p| p.name.starts_with("attention backward"));
    assert_eq!(part.map(|p| p.bytes), Some(131072 * 4608 * 4 - logits), "{:?}", long.budget);
    let short = fits(check("qwen2.5-7b", (1024, 8, 8), H200, true));
    assert!(short.budget.device.parts.iter().all(|p| !p.name.starts_with("attention backward")));
}

/// The disk tier of the tests: a folder on an SSD reading and writing at `rate` bytes/s.
fn disk(bytes: u64, rate: u64) -> DiskSpace {
    DiskSpace {
        dir: "/mnt/nvme/sluice".into(),
        bytes,
        read_bytes_per_s: rate,
        write_bytes_per_s: rate,
        source: MemorySource::Given,
    }
}

const GB: u64 = 1_000_000_000;

/// Qwen2.5-7B, 8 micro-batches of 8 x 1024 tokens, clipping on, on one H200 (139 GiB) with
/// `host` bytes of host memory, the disk tier `tier` and the moments policy `moments`.
fn seven_b_with(moments: MomentsPolicy, host: u64, tier: Option<DiskSpace>) -> Verdict {
    let memory = MachineMemory { disk: tier, ..MachineMemory::given(139 * GIB, host) };
    plan_with("qwen2.5-7b", (1024, 8, 8), memory, Capabilities { moments, ..Capabilities::ALL })
}

/// One unit's m and v in the disk tier's file: fp32, each rounded up to a page.
fn on_disk(params: u64) -> u64 {
    2 * (4 * params).next_multiple_of(4096)
}

#[test]
fn auto_moves_the_last_layers_moments_to_the_disk_tier_as_far_as_host_memory_needs() {
    // 12 bytes per parameter of master and moments (85 GiB) do not fit 64 GiB of host memory;
    // with a 200 GiB disk tier the last layers' moments move there, no more than needed.
    let tier = disk(200 * GIB, 2 * GB);
    let plan = fits(seven_b_with(MomentsPolicy::Auto, 64 * GIB, Some(tier.clone())));
    let pl = &plan.placement;
    let (layers, head) = (QWEN7.layers as usize, QWEN7.layers as usize + 1);
    let n = pl.disk_units.len();
    assert!(n > 0 && n < layers, "some but not all layers: {n}\n{plan}");
    let last: Vec<usize> = (layers + 1 - n..=layers).collect();
    assert_eq!(pl.disk_units, last, "the last layers, no embedding or head\n{plan}");
    assert_eq!(pl.disk_summary, format!("layers {}-{}", layers - n, layers - 1));
    assert!(!pl.disk_units.contains(&0) && !pl.disk_units.contains(&head));
    let b = &plan.budget;
    assert!(b.host_used() <= 64 * GIB, "{plan}");
    // The fewest: one layer's moments (and their two alignment pages) back in host memory
    // would not fit.
    assert!(b.host_used() + 8 * QWEN7.layer() + 2 * 4096 > 64 * GIB, "{plan}");

    // The budget by hand: host moments of the other units only, the staging of three layers'
    // m and v, the disk tier holding each disk layer's m and v page-aligned.
    let host_params = QWEN7.params() - n as u64 * QWEN7.layer();
    assert_eq!(b.pageable_host.part("Adam first moment m"), 4 * host_params, "{plan}");
    assert_eq!(b.pageable_host.part("Adam second moment v"), 4 * host_params, "{plan}");
    assert_eq!(b.pageable_host.part("disk tier staging"), 3 * on_disk(QWEN7.layer()));
    let units = QWEN7.layers + 2;
    let host_units = units - n as u64;
    assert_eq!(b.pageable_host.part("slab alignment"), 2 * host_units * 4096, "{plan}");
    let d = b.disk.as_ref().expect("a disk tier");
    assert_eq!((d.tier, d.capacity), (TierName::Disk, 200 * GIB));
    assert_eq!(d.used, n as u64 * on_disk(QWEN7.layer()), "{plan}");
    assert_eq!(b.tiers().len(), 4);
    assert_eq!(b.tiers()[3].tier.label(), "disk tier");
    // Each step reads and writes every disk unit's m and v once, at 2 GB/s each way.
    let t = &plan.time;
    assert_eq!(t.disk_bytes, 2 * d.used);
    assert!((t.disk_s - 2.0 * d.used as f64 / 2e9).abs() < 1e-9, "{}", t.disk_s);
    assert!(t.total_s >= t.disk_s, "{plan}");

    // The text says where the moments are and why, and prints the disk tier's budget.
    let text = plan.to_string();
    let line = plan.disk_text().expect("a disk line");
    assert!(
        line.starts_with(&format!(
            "Adam moments of {} live on the disk tier at /mnt/nvme/sluice (",
            pl.disk_summary
        )),
        "{line}"
    );
    assert!(line.contains("read and written at 2.0/2.0 GB/s each step"), "{line}");
    assert!(line.contains("host memory is ") && line.contains(" short without it"), "{line}");
    assert!(text.contains(&line), "{text}");
    assert!(text.contains("  disk tier "), "{text}");
    assert!(text.contains("Adam moments m and v (fp32, "), "{text}");
    // The streamer is told exactly those units and the tier's folder.
    let options = crate::schedule::from_plan::schedule_options(&plan, 0).expect("options");
    let planned = options.disk.expect("disk options");
    assert_eq!((planned.dir, planned.units), (tier.dir.clone(), pl.disk_units.clone()));

    // Host memory only, or no disk tier: the same job does not fit, for host memory.
    for refused_plan in [
        seven_b_with(MomentsPolicy::Host, 64 * GIB, Some(tier.clone())),
        seven_b_with(MomentsPolicy::Auto, 64 * GIB, None),
    ] {
        let r = refused(refused_plan);
        assert_eq!(r.overflows[0].memory, Memory::Host, "{r}");
        assert_eq!(r.budget.disk_used(), 0, "{r}");
    }
    // A schedule without the disk tier is not offered it either.
    let memory = MachineMemory { disk: Some(tier), ..MachineMemory::given(139 * GIB, 64 * GIB) };
    let caps = Capabilities { disk_moments: false, ..Capabilities::ALL };
    refused(plan_with("qwen2.5-7b", (1024, 8, 8), memory, caps));
}

#[test]
fn disk_puts_every_units_moments_on_the_disk_tier() {
    let plan = fits(seven_b_with(MomentsPolicy::Disk, H200.1, Some(disk(200 * GIB, 2 * GB))));
    let units = QWEN7.layers as usize + 2;
    assert_eq!(plan.placement.disk_units, (0..units).collect::<Vec<_>>(), "{plan}");
    assert_eq!(plan.placement.disk_summary, "embedding, layers 0-27, head");
    assert!(plan.placement.disk_reason.contains("as asked"), "{plan}");
    let b = &plan.budget;
    assert_eq!(b.pageable_host.part("Adam"), 0, "no moments in host memory\n{plan}");
    // The staging holds three of the largest unit's m and v: the untied head.
    let head = QWEN7.vocab * QWEN7.hidden + QWEN7.hidden;
    assert_eq!(b.pageable_host.part("disk tier staging"), 3 * on_disk(head), "{plan}");
    let by_hand =
        on_disk(QWEN7.vocab * QWEN7.hidden) + QWEN7.layers * on_disk(QWEN7.layer()) + on_disk(head);
    assert_eq!(b.disk_used(), by_hand, "{plan}");

    // Asked for without a disk tier (or a schedule that has one): an error saying so.
    let err = plan_input_error(MomentsPolicy::Disk, None, true);
    assert!(err.contains("moments is disk") && err.contains("no disk tier"), "{err}");
    let err = plan_input_error(MomentsPolicy::Disk, Some(disk(200 * GIB, 2 * GB)), false);
    assert!(err.contains("cannot keep Adam moments on a disk tier"), "{err}");
    // A disk tier that cannot move a byte is invalid.
    let err = plan_input_error(MomentsPolicy::Auto, Some(disk(200 * GIB, 0)), true);
    assert!(err.contains("disk tier at /mnt/nvme/sluice must read and write"), "{err}");
}

/// The planner's error for the 7B job with `moments`, the disk tier `tier` and a schedule
/// that does (or does not) keep moments on a disk.
fn plan_input_error(moments: MomentsPolicy, tier: Option<DiskSpace>, disk_moments: bool) -> String {
    let spec = preset("qwen2.5-7b").expect("preset");
    let input = PlanInput {
        spec: &spec,
        batch: BatchShape { seq_len: 1024, micro_batch: 8, grad_accum: 8 },
        clipping: true,
        memory: MachineMemory { disk: tier, ..MachineMemory::given(H200.0, H200.1) },
        rates: MachineRates::default(),
        supports: Capabilities { moments, disk_moments, ..Capabilities::ALL },
        gpus: 1,
    };
    match plan(&input) {
        Ok(v) => panic!("expected an error, got {v:?}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn a_disk_tier_too_small_refuses_and_names_the_disk() {
    let r = refused(seven_b_with(MomentsPolicy::Auto, 64 * GIB, Some(disk(10 * GIB, 2 * GB))));
    assert_eq!(r.overflows.len(), 1, "{r}");
    let o = &r.overflows[0];
    assert_eq!((o.memory, o.capacity), (Memory::Disk, 10 * GIB), "{r}");
    assert_eq!(o.over_by, o.needed - 10 * GIB);
    assert!(r.reason.starts_with("disk tier at /mnt/nvme/sluice"), "{}", r.reason);
    assert!(r.fits.contains(&Suggestion::DiskSpace(o.needed)), "{r}");
    assert!(r.to_string().contains("on the disk tier"), "{r}");
    assert!(r.details().contains("disk tier"), "{}", r.details());
    // With the space it names, it fits; a page less does not.
    fits(seven_b_with(MomentsPolicy::Auto, 64 * GIB, Some(disk(o.needed, 2 * GB))));
    refused(seven_b_with(MomentsPolicy::Auto, 64 * GIB, Some(disk(o.needed - 4096, 2 * GB))));
}

#[test]
fn a_disk_tier_is_not_used_where_host_memory_holds_the_job() {
    // The H200 machine holds 7B in host memory: the disk tier is shown, empty, and the plan is
    // the one without it.
    let with = fits(seven_b_with(MomentsPolicy::Auto, H200.1, Some(disk(200 * GIB, 2 * GB))));
    let without = fits(seven_b_with(MomentsPolicy::Auto, H200.1, None));
    assert!(with.placement.disk_units.is_empty(), "{with}");
    assert_eq!(with.placement, without.placement);
    assert_eq!(with.time, without.time);
    assert_eq!(with.budget.disk_used(), 0);
    assert_eq!(with.budget.disk.as_ref().map(|d| d.capacity), Some(200 * GIB));
    assert_eq!(without.budget.disk, None);
    assert_eq!(without.budget.tiers().len(), 3);
    assert!(
        with.disk_text().is_none()
            && with.to_string().contains("moments: Adam m and v in host memory")
    );
    assert_eq!(serde_json::to_value(&with.budget).expect("json")["disk"]["tier"], "disk");
}

#[test]
fn a_slow_disk_tier_bounds_the_step_and_more_disk_units_cost_more() {
    let step = |moments, rate| {
        let plan = fits(seven_b_with(moments, 64 * GIB, Some(disk(200 * GIB, rate))));
        (plan.placement.disk_units.len(), plan.time)
    };
    let (n, slow) = step(MomentsPolicy::Auto, GB / 2);
    assert_eq!(slow.bottleneck, Bottleneck::Disk, "{slow:?}");
    // Read and written once a step at 0.5 GB/s each way.
    let bytes = n as u64 * on_disk(QWEN7.layer());
    assert!((slow.disk_s - 2.0 * bytes as f64 / 0.5e9).abs() < 1e-9, "{slow:?}");
    assert!(slow.total_s >= slow.disk_s && slow.disk_s > slow.compute_s, "{slow:?}");
    // A disk far faster than the rest hides behind the step.
    let (fast_n, fast) = step(MomentsPolicy::Auto, 200 * GB);
    assert_eq!(fast_n, n);
    assert_ne!(fast.bottleneck, Bottleneck::Disk, "{fast:?}");
    assert!(fast.total_s < slow.total_s / 4.0, "{fast:?} vs {slow:?}");
    // Every unit's moments on the same slow disk: a longer step.
    let (all, every) = step(MomentsPolicy::Disk, GB / 2);
    assert_eq!(all, QWEN7.layers as usize + 2);
    assert!(every.disk_s > slow.disk_s && every.total_s > slow.total_s, "{every:?}");
    // AdamW's own time is every unit's update, wherever its moments are.
    assert!((every.adam_s - QWEN7.params() as f64 / 5e9).abs() < 1e-9, "{every:?}");
}

#[test]
fn gradient_options_and_the_disk_question_follow_the_moments_policy() {
    let spec = preset("qwen2.5-7b").expect("preset");
    let tier = disk(200 * GIB, 2 * GB);
    let input = |moments, host: u64, tier: Option<DiskSpace>| PlanInput {
        spec: &spec,
        batch: BatchShape { seq_len: 1024, micro_batch: 8, grad_accum: 8 },
        clipping: true,
        memory: MachineMemory { disk: tier, ..MachineMemory::given(139 * GIB, host) },
        rates: MachineRates::default(),
        supports: Capabilities { moments, ..Capabilities::ALL },
        gpus: 1,
    };
    // On 64 GiB every policy but the fp32 host store fits with the disk tier, and needs it
    // (the fp32 master and gradient store alone are 57 GiB, the staging of the embedding's
    // and head's moments 12 more); none fits without.
    let auto =
        gradient_options(&input(MomentsPolicy::Auto, 64 * GIB, Some(tier.clone()))).expect("valid");
    let fit: Vec<_> = auto.iter().map(|o| o.fits).collect();
    assert_eq!(fit, [true, false, true, true], "{auto:#?}");
    assert!(auto.iter().all(|o| o.disk_bytes > 0), "{auto:#?}");
    assert!(auto[1].refused.as_deref().unwrap_or("").contains("host memory"), "{auto:#?}");
    let host =
        gradient_options(&input(MomentsPolicy::Host, 64 * GIB, Some(tier.clone()))).expect("valid");
    assert!(host.iter().all(|o| !o.fits && o.disk_bytes == 0), "{host:#?}");
    // A disk tier is worth measuring only where it changes the verdict.
    let wants = |moments, host| wants_disk(&input(moments, host, None)).expect("valid");
    assert!(wants(MomentsPolicy::Auto, 64 * GIB));
    assert!(!wants(MomentsPolicy::Host, 64 * GIB));
    assert!(wants(MomentsPolicy::Disk, H200.1));
    // 125 GiB holds every policy; 8 GiB holds not even the master weights.
    assert!(!wants(MomentsPolicy::Auto, H200.1));
    assert!(!wants(MomentsPolicy::Auto, 8 * GIB));
}

#[test]
fn the_gradient_store_is_chosen_with_the_kept_activations_it_leaves_room_for() {
    // Qwen2.5-7B at 2 x 32,768 tokens on an 80 GB H100: the device store's 28 GiB leave room
    // for 17 layers' attention outputs, the host store for every layer's and 2 whole layers.
    // Both clip exactly in fp32; the faster must win, as every gradient option would show.
    let memory = MachineMemory::given(84_000_000_000, 134_000_000_000);
    let spec = preset("qwen2.5-7b").expect("preset");
    let input = PlanInput {
        spec: &spec,
        batch: BatchShape { seq_len: 32768, micro_batch: 1, grad_accum: 2 },
        clipping: true,
        memory: memory.clone(),
        rates: MachineRates::default(),
        supports: Capabilities::ALL,
        gpus: 1,
    };
    let plan = fits(plan(&input).expect("valid input"));
    assert_eq!(plan.placement.gradients, GradientTier::HostStore, "{plan}");
    assert_eq!(plan.placement.kept_attention_layers.len() + plan.placement.kept_layers.len(), 28);
    let options = gradient_options(&input).expect("options");
    let device = options.iter().find(|o| o.gradients == GradientTier::DeviceStore).expect("device");
    let device_s = device.step_s.expect("the device store fits too");
    assert!(
        plan.time.total_s < device_s * 0.97,
        "{} s against {device_s} s\n{plan}",
        plan.time.total_s
    );
    // The plan says why, with both times.
    let reason = &plan.placement.gradients_reason;
    assert!(reason.starts_with("faster than the device store"), "{plan}");
    let times = format!("{:.2} s a step against {device_s:.2} s", plan.time.total_s);
    assert!(reason.ends_with(&times), "{reason}");
    assert!(plan.to_string().contains(&format!("host store ({reason})")), "{plan}");
    for o in options.iter().filter(|o| o.gradients.clips() && o.fits) {
        assert!(plan.time.total_s <= o.step_s.expect("fits") * 1.01, "{o:?}\n{plan}");
    }
    // Without kept activations the two stores are as fast, and the simpler one is chosen.
    let no_kept = Capabilities { keep_activations: false, ..Capabilities::ALL };
    let p = fits(plan_with("qwen2.5-7b", (32768, 1, 2), memory, no_kept));
    assert_eq!(p.placement.gradients, GradientTier::DeviceStore, "{p}");
    assert_eq!(p.placement.gradients_reason, "", "{p}");
}
