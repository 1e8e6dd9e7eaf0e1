//! The streaming schedule against the plain reference loop: same losses, same gradient norms,
//! same final parameters, for every family, with G = 4 micro-batches per step.

mod support;

use std::path::Path;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use sluice_engine::backend::cpu::Cpu;
use sluice_engine::data::MicroBatch;
use sluice_engine::model::HostParams;
use sluice_engine::optim::Schedule;
use sluice_engine::schedule::{
    CheckpointTier, DiskOptions, GradientTier, RING_SLOTS, ScheduleOptions, Streamer, WeightSource,
};
use sluice_engine::spec::ModelSpec;
use sluice_engine::train::{TrainConfig, Trainer};

use support::micro_batch;

const G: usize = 4;
const STEPS: usize = 5;
const COPY: WeightSource = WeightSource::StreamingCopy;
const MASTER: WeightSource = WeightSource::Master;

#[path = "support/cases.rs"]
mod cases;
use cases::GOLDEN_CASES as FAMILIES;

fn config(clip: Option<f32>) -> TrainConfig {
    TrainConfig {
        lr: 1e-2,
        schedule: Schedule::Cosine,
        warmup_steps: 1,
        total_steps: STEPS as u64,
        weight_decay: 0.1,
        max_grad_norm: clip,
        ..TrainConfig::default()
    }
}

/// The streamer's options for these tests' micro-batches: nothing resident, weights from a
/// copy, a full ring, no disk tier, every activation recomputed.
fn options(
    (checkpoints, checkpoint_interval): (CheckpointTier, usize),
    gradients: GradientTier,
) -> ScheduleOptions {
    ScheduleOptions {
        max_tokens: 32,
        grad_accum: G,
        checkpoints,
        checkpoint_interval,
        optimizer_threads: 2,
        resident: Vec::new(),
        gradients,
        weights: COPY,
        ring_slots: RING_SLOTS,
        disk: None,
        kept: Vec::new(),
        kept_attention: Vec::new(),
    }
}

fn check(
    case: &str,
    checkpointing: (CheckpointTier, usize),
    gradients: GradientTier,
    clip: Option<f32>,
    resident: Vec<usize>,
    weights: WeightSource,
) {
    check_ring(case, checkpointing, (gradients, RING_SLOTS), clip, resident, weights);
}

/// [`check`] with the gradient ring's slot count given.
fn check_ring(
    case: &str,
    checkpointing: (CheckpointTier, usize),
    ring: (GradientTier, usize),
    clip: Option<f32>,
    resident: Vec<usize>,
    weights: WeightSource,
) {
    check_disk(case, checkpointing, ring, clip, (resident, weights), (&[], Kept::default()));
}

/// Decoder layers whose activations the streamer keeps from the forward to the backward: all
/// of them (`layers`, no recompute) or only the attention's output (`attention`, the recompute
/// skips the attention).
#[derive(Debug, Clone, Copy, Default)]
struct Kept<'a> {
    layers: &'a [usize],
    attention: &'a [usize],
}

/// [`check_ring`] with the Adam moments of units `disk` on the disk tier and the activations of
/// the layers in `kept` kept from the forward to the backward.
fn check_disk(
    case: &str,
    (checkpoints, checkpoint_interval): (CheckpointTier, usize),
    (gradients, ring_slots): (GradientTier, usize),
    clip: Option<f32>,
    (resident, weights): (Vec<usize>, WeightSource),
    (disk, kept): (&[usize], Kept<'_>),
) {
    let (spec, params): (ModelSpec, HostParams) = if case == "tiny" {
        // The 4-layer preset: deep enough for several checkpoint groups.
        let spec = sluice_engine::spec::preset("tiny").expect("tiny preset");
        let params = HostParams::random(&spec, 5);
        (spec, params)
    } else {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/golden").join(case);
        HostParams::load_dir(&dir).expect("model")
    };
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let steps: Vec<Vec<MicroBatch>> =
        (0..STEPS).map(|_| (0..G).map(|_| micro_batch(&mut rng, spec.vocab)).collect()).collect();
    let cpu = Cpu;
    let mut reference =
        Trainer::new(&cpu, &spec, params.clone(), config(clip), 32).expect("trainer");
    let tier_dir = tempfile::tempdir().expect("a folder for the disk tier");
    let options = ScheduleOptions {
        resident,
        weights,
        ring_slots,
        disk: (!disk.is_empty())
            .then(|| DiskOptions { dir: tier_dir.path().to_path_buf(), units: disk.to_vec() }),
        kept: kept.layers.to_vec(),
        kept_attention: kept.attention.to_vec(),
        ..options((checkpoints, checkpoint_interval), gradients)
    };
    let mut streamer = Streamer::new(&cpu, &spec, params, config(clip), options).expect("streamer");
    let files = || std::fs::read_dir(tier_dir.path()).expect("tier folder").count();
    assert_eq!(files(), usize::from(!disk.is_empty()), "{case}: the disk tier's file");
    let mut disk_traffic = (0, 0);
    for (k, micro) in steps.iter().enumerate() {
        let want = reference.step(micro).expect("reference step");
        let (got, traffic) = streamer.step(micro).expect("streaming step");
        disk_traffic.0 += traffic.disk.read_bytes;
        disk_traffic.1 += traffic.disk.write_bytes;
        // Untied models compute exactly the same operations in the same order (gradients
        // accumulate over micro-batches 0..G per unit in both), so the results are bitwise
        // equal. A tied embedding sums the head's and the embedding's contributions in another
        // order (all head parts first), which moves the last bits: 1e-6 relative.
        let tol = if spec.tie_embeddings { 1e-6 } else { 0.0 };
        assert!(
            (got.loss - want.loss).abs() <= tol * want.loss.abs(),
            "{case} step {k}: loss {} vs {}",
            got.loss,
            want.loss
        );
        assert!(
            (got.grad_norm - want.grad_norm).abs() <= tol * want.grad_norm.abs(),
            "{case} step {k}: grad norm {} vs {}",
            got.grad_norm,
            want.grad_norm
        );
        assert_eq!(got.lr, want.lr);
        // Weights cross once up and once down per step whatever G is: forward and backward
        // uploads of every layer, one upload each of the embedding and the head.
        let layers: usize = spec.layers;
        assert!(traffic.h2d_bytes > 0 && traffic.d2h_bytes > 0, "{layers} layers moved nothing");
        // The timeline has every unit's compute, forward and backward, and one gradient
        // landing. Gradients kept on the device land after the norm, the first ring-slots units
        // at the end of their step and the others during the next forward.
        for unit in 0..layers + 2 {
            let on = |stream: &str| {
                got.timeline.iter().filter(|s| s.unit == unit && s.stream == stream).count()
            };
            // With K > 1 a layer below the top of its group also recomputes its output.
            let interval = checkpoint_interval;
            let recomputed = (1..=layers).contains(&unit) && unit % interval != 0 && unit != layers;
            let compute = if unit == layers + 1 { 1 } else { 2 + usize::from(recomputed) };
            let deferred = gradients == GradientTier::DeviceStore && k == 0 && unit >= ring_slots;
            let landings = if deferred { 0 } else { 1 };
            assert_eq!(
                (on("compute"), on("d2h")),
                (compute, landings),
                "{case} unit {unit} step {k} timeline"
            );
        }
    }
    // Held-out loss with the final weights: forward only, the same sums in the same order.
    let held_out: Vec<MicroBatch> = (0..G + 1).map(|_| micro_batch(&mut rng, spec.vocab)).collect();
    let want = reference.eval_loss(&held_out).expect("reference eval");
    let got = streamer.eval_loss(&held_out).expect("streaming eval");
    let tol = if spec.tie_embeddings { 1e-6 } else { 0.0 };
    assert!((got - want).abs() <= tol * want.abs(), "{case}: eval loss {got} vs {want}");

    // The transfers that finished after the last step's figures were taken, once every update
    // has settled, so a loaded machine's late write-backs are counted too.
    let store = streamer.settled_store().expect("settles");
    if let Some(stage) = store.disk() {
        let rest = stage.take_stats();
        disk_traffic.0 += rest.read_bytes;
        disk_traffic.1 += rest.write_bytes;
    }
    drop(store);
    let got = streamer.finish().expect("finish");
    // Every disk unit is read before and written after each update. A step's figures count the
    // transfers finished by its end: the last update's and (hidden behind the last step) the one
    // before's write-backs may still be under way, so STEPS - 2 updates are certainly counted.
    let unit_bytes: u64 = disk
        .iter()
        .map(|&u| 2 * (reference.params.units[u].len() * 4).next_multiple_of(4096) as u64)
        .sum();
    assert!(
        disk_traffic.1 >= (STEPS as u64 - 2) * unit_bytes
            && disk_traffic.0 >= disk_traffic.1 - unit_bytes,
        "{case}: disk traffic {disk_traffic:?} for {unit_bytes} bytes of moments"
    );
    drop(streamer);
    assert_eq!(files(), 0, "{case}: the disk tier's file outlived the run");
    for (u, (a, b)) in got.units.iter().zip(&reference.params.units).enumerate() {
        let scale = b.iter().fold(0f32, |m, x| m.max(x.abs()));
        let worst = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        let tol = if spec.tie_embeddings { 1e-5 } else { 0.0 };
        assert!(
            worst <= tol * scale,
            "{case} unit {u}: parameters differ by {worst} (scale {scale})"
        );
    }
}

#[test]
fn streaming_equals_reference_host_checkpoints_clipped() {
    for case in FAMILIES {
        check(
            case,
            (CheckpointTier::Host, 1),
            GradientTier::HostStore,
            Some(1.0),
            Vec::new(),
            COPY,
        );
        check(
            case,
            (CheckpointTier::Host, 1),
            GradientTier::DeviceStore,
            Some(1.0),
            Vec::new(),
            COPY,
        );
    }
}

#[test]
fn streaming_equals_reference_device_checkpoints_unclipped() {
    for case in FAMILIES.into_iter().filter(|c| *c != "llama-linear") {
        check(case, (CheckpointTier::Device, 1), GradientTier::HostRing, None, Vec::new(), COPY);
        check(case, (CheckpointTier::Device, 1), GradientTier::DeviceStore, None, Vec::new(), COPY);
    }
}

#[test]
fn resident_units_give_the_same_results_with_less_traffic() {
    // The embedding, the first layer and the head stay on the device.
    for case in ["llama", "qwen2"] {
        check(
            case,
            (CheckpointTier::Device, 1),
            GradientTier::HostStore,
            Some(1.0),
            vec![0, 1, 3],
            COPY,
        );
    }
}

#[test]
fn kept_activations_give_the_same_results_without_the_recompute() {
    // The forward writes a kept layer's state (or its attention output) where its backward
    // reads it; the recompute it replaces computed the same values, so the results are the
    // reference's bits. Every family: a dense one with one layer kept (beside recomputed ones),
    // all of them, one kept beside one whose attention output is kept, and every attention
    // output kept; a mixture of experts keeps attention outputs only.
    for case in FAMILIES.into_iter().chain(["tiny"]) {
        let moe = ["mixtral", "qwen3_moe", "gpt_oss", "qwen2_moe"].contains(&case);
        let layers = if case == "tiny" { 4 } else { 2 };
        let all: Vec<usize> = (0..layers).collect();
        let none: &[usize] = &[];
        let dense_sets = [
            Kept { layers: &[1], attention: none },
            Kept { layers: &all, attention: none },
            Kept { layers: &[0], attention: &[1] },
            Kept { layers: none, attention: &all },
        ];
        let moe_sets =
            [Kept { layers: none, attention: &[1] }, Kept { layers: none, attention: &all }];
        let sets: &[Kept<'_>] = if moe { &moe_sets } else { &dense_sets };
        for &kept in sets {
            check_disk(
                case,
                (CheckpointTier::Device, 1),
                (GradientTier::DeviceStore, RING_SLOTS),
                Some(1.0),
                (vec![0, 1], COPY),
                (&[], kept),
            );
            check_disk(
                case,
                (CheckpointTier::Device, 1),
                (GradientTier::HostRing, RING_SLOTS),
                None,
                (Vec::new(), MASTER),
                (&[], kept),
            );
        }
    }
}

/// A mixture of experts keeps no whole layer's activations, and kept activations (whole or
/// attention outputs) need every layer's input checkpointed on the device: the streamer
/// refuses other options rather than run them.
#[test]
fn kept_activations_are_refused_where_the_schedule_cannot_keep_them() {
    let cpu = Cpu;
    let options = |checkpoints, interval| ScheduleOptions {
        kept: vec![0],
        ..options((checkpoints, interval), GradientTier::HostStore)
    };
    let spec = sluice_engine::spec::preset("tiny").expect("tiny preset");
    let params = || HostParams::random(&spec, 5);
    for (tier, k) in [(CheckpointTier::Host, 1), (CheckpointTier::Device, 2)] {
        let err = Streamer::new(&cpu, &spec, params(), config(None), options(tier, k))
            .err()
            .expect("refused");
        assert!(err.to_string().contains("checkpointed on the device"), "{err}");
    }
    let beyond = ScheduleOptions { kept: vec![4], ..options(CheckpointTier::Device, 1) };
    let err = Streamer::new(&cpu, &spec, params(), config(None), beyond).err().expect("no layer 4");
    assert!(err.to_string().contains("no layer 4"), "{err}");
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/golden/mixtral");
    let (moe, p) = HostParams::load_dir(&dir).expect("model");
    let err = Streamer::new(&cpu, &moe, p, config(None), options(CheckpointTier::Device, 1))
        .err()
        .expect("a mixture of experts");
    assert!(err.to_string().contains("mixture of experts"), "{err}");
    // Kept attention outputs: the same conditions, and a layer kept whole keeps its attention.
    let attention = |checkpoints, interval, kept: Vec<usize>, kept_attention| ScheduleOptions {
        kept,
        kept_attention,
        ..options(checkpoints, interval)
    };
    let refused = |o: ScheduleOptions| {
        Streamer::new(&cpu, &spec, params(), config(None), o).err().expect("refused").to_string()
    };
    let err = refused(attention(CheckpointTier::Host, 1, vec![], vec![1]));
    assert!(err.contains("checkpointed on the device"), "{err}");
    let err = refused(attention(CheckpointTier::Device, 2, vec![], vec![1]));
    assert!(err.contains("checkpointed on the device"), "{err}");
    let err = refused(attention(CheckpointTier::Device, 1, vec![], vec![4]));
    assert!(err.contains("no layer 4"), "{err}");
    let err = refused(attention(CheckpointTier::Device, 1, vec![2], vec![1, 2]));
    assert!(err.contains("layer 2 keeps all its activations"), "{err}");
}

#[test]
fn a_checkpoint_interval_recomputes_to_the_same_results() {
    // Over 4 layers: K = 2 makes two groups of two, K = 3 a group of three under a group of
    // one, K = 8 one group with every input but the first recomputed; in both tiers. The
    // 2-layer fixtures cover an untied model (bitwise equality) and a tied one.
    for case in ["tiny", "llama", "qwen2", "gpt_oss"] {
        for k in [2, 3, 8] {
            check(
                case,
                (CheckpointTier::Device, k),
                GradientTier::HostStore,
                Some(1.0),
                Vec::new(),
                COPY,
            );
            check(case, (CheckpointTier::Host, k), GradientTier::HostRing, None, Vec::new(), COPY);
            // The tiny preset's 6 units outnumber the ring's slots: landings rotate through it.
            check(
                case,
                (CheckpointTier::Device, k),
                GradientTier::DeviceStore,
                Some(1.0),
                Vec::new(),
                COPY,
            );
        }
    }
}

#[test]
fn a_two_slot_ring_equals_the_reference() {
    // Where host memory is short the planner keeps two ring slots: every landing then waits for
    // the update two units back, in the device store (clipping) and the ring (no clipping).
    for case in ["tiny", "llama"] {
        let ring = (GradientTier::HostRing, 2);
        check_ring(case, (CheckpointTier::Device, 1), ring, None, Vec::new(), MASTER);
        let store = (GradientTier::DeviceStore, 2);
        check_ring(case, (CheckpointTier::Host, 2), store, Some(1.0), Vec::new(), MASTER);
    }
}

#[test]
fn streaming_from_the_master_equals_the_reference() {
    // No streaming copy: the device reads the master, the optimizer refreshes no copy.
    for case in ["llama", "qwen2"] {
        check(
            case,
            (CheckpointTier::Host, 1),
            GradientTier::HostStore,
            Some(1.0),
            Vec::new(),
            MASTER,
        );
        check(case, (CheckpointTier::Device, 1), GradientTier::HostRing, None, vec![0, 3], MASTER);
        check(
            case,
            (CheckpointTier::Device, 2),
            GradientTier::DeviceStore,
            Some(1.0),
            Vec::new(),
            MASTER,
        );
        // Gradients in the weight dtype: f32 on the CPU, so the same bits.
        check(
            case,
            (CheckpointTier::Device, 1),
            GradientTier::HostStoreBf16,
            Some(1.0),
            Vec::new(),
            COPY,
        );
    }
}

#[test]
fn moments_on_the_disk_tier_equal_the_reference() {
    // The moments of some or all units live in a file: read ahead of each update, written back
    // after it, the same bits as moments in memory, with updates as gradients land (the ring),
    // after the norm in forward order (host and device stores), and a MoE layer's many tensors.
    for case in ["tiny", "llama", "mixtral"] {
        let units = if case == "tiny" { 6 } else { 4 };
        let all: Vec<usize> = (0..units).collect();
        let ring = (GradientTier::HostRing, RING_SLOTS);
        let no_kept = Kept::default();
        let (ckpt, copy) = ((CheckpointTier::Device, 1), (Vec::new(), MASTER));
        check_disk(case, ckpt, ring, None, copy, (&all, no_kept));
        let store = (GradientTier::HostStore, RING_SLOTS);
        let (ckpt, copy) = ((CheckpointTier::Host, 1), (vec![0], COPY));
        check_disk(case, ckpt, store, Some(1.0), copy, (&[1, 2], no_kept));
        let device = (GradientTier::DeviceStore, 2);
        check_disk(
            case,
            (CheckpointTier::Device, 2),
            device,
            Some(1.0),
            (Vec::new(), MASTER),
            (&[0, units - 1], no_kept),
        );
    }
}

/// The device store keeps a step's gradients after the step (the next backward zeroes them):
/// read back, they are the reference's gradients of the same micro-batches, tensor for tensor.
/// The tiers that hand each unit's gradients over as it finishes have none to give.
#[test]
fn the_device_store_gives_back_the_steps_gradients() {
    let spec = sluice_engine::spec::preset("tiny").expect("tiny preset");
    let params = HostParams::random(&spec, 5);
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let micro: Vec<MicroBatch> = (0..G).map(|_| micro_batch(&mut rng, spec.vocab)).collect();
    let cpu = Cpu;
    let mut reference =
        Trainer::new(&cpu, &spec, params.clone(), config(Some(1.0)), 32).expect("trainer");
    let (_, want) = reference.loss_and_grads(&micro).expect("reference gradients");
    let want = want.to_vec();
    let store = options((CheckpointTier::Device, 1), GradientTier::DeviceStore);
    let mut streamer =
        Streamer::new(&cpu, &spec, params.clone(), config(Some(1.0)), store).expect("streamer");
    streamer.step(&micro).expect("step");
    let norms = streamer.grad_norms();
    for (u, want) in want.iter().enumerate() {
        let got = streamer.stored_gradients(u).expect("stored gradients");
        assert_eq!(got.len(), want.len(), "unit {u}");
        let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
        let worst = got.iter().zip(want).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        let tol = if spec.tie_embeddings { 1e-5 } else { 0.0 };
        assert!(worst <= tol * scale, "unit {u}: gradients differ by {worst} (scale {scale})");
        let norm = got.iter().map(|&x| f64::from(x) * f64::from(x)).sum::<f64>().sqrt();
        assert!((norm - norms[u]).abs() <= 1e-6 * norms[u], "unit {u}: {norm} vs {}", norms[u]);
    }
    assert!(streamer.stored_gradients(want.len()).is_err(), "a unit past the last");
    drop(streamer);
    let host = options((CheckpointTier::Device, 1), GradientTier::HostStore);
    let mut streamer = Streamer::new(&cpu, &spec, params, config(Some(1.0)), host).expect("host");
    streamer.step(&micro).expect("step");
    let err = streamer.stored_gradients(1).expect_err("host store keeps none on the device");
    assert!(err.to_string().contains("device store"), "{err}");
}
