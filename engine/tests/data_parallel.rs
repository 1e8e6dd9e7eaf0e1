//! Data parallelism on the CPU: ranks in threads, summing gradients through shared memory, against
//! the single streamer over the same micro-batches. One rank must equal it bit for bit; two
//! ranks sum each unit's gradients in another association, so they agree within rounding.

mod support;

use std::path::Path;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use sluice_engine::backend::AllReduce;
use sluice_engine::backend::cpu::Cpu;
use sluice_engine::data::MicroBatch;
use sluice_engine::model::HostParams;
use sluice_engine::schedule::{
    CheckpointTier, CpuGroup, DataParallel, GradientTier, RING_SLOTS, ScheduleOptions, Streamer,
    WeightSource,
};
use sluice_engine::spec::ModelSpec;
use sluice_engine::train::TrainConfig;

use support::micro_batch;

const G: usize = 4;
const STEPS: usize = 3;

fn golden(case: &str) -> (ModelSpec, HostParams) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/golden").join(case);
    HostParams::load_dir(&dir).expect("model")
}

fn options(gradients: GradientTier) -> ScheduleOptions {
    ScheduleOptions {
        max_tokens: 32,
        grad_accum: G,
        checkpoints: CheckpointTier::Host,
        checkpoint_interval: 1,
        optimizer_threads: 2,
        resident: Vec::new(),
        gradients,
        weights: WeightSource::Master,
        ring_slots: RING_SLOTS,
        disk: None,
        kept: Vec::new(),
        kept_attention: Vec::new(),
    }
}

fn config(clip: Option<f32>) -> TrainConfig {
    TrainConfig {
        lr: 1e-2,
        total_steps: STEPS as u64,
        max_grad_norm: clip,
        ..TrainConfig::default()
    }
}

/// Largest difference of any weight, relative to the largest weight of its unit.
fn weight_err(a: &HostParams, b: &HostParams) -> f64 {
    let mut worst = 0f64;
    for (x, y) in a.units.iter().zip(&b.units) {
        let scale = y.iter().fold(0f64, |m, &v| m.max(f64::from(v).abs())).max(1e-30);
        for (p, q) in x.iter().zip(y) {
            worst = worst.max(f64::from(p - q).abs() / scale);
        }
    }
    worst
}

/// Runs `STEPS` steps on `world` CPU ranks and on the single streamer; returns the largest
/// relative loss and grad-norm differences and the weights' difference.
fn compare(case: &str, world: usize, gradients: GradientTier, clip: Option<f32>) -> [f64; 3] {
    let (spec, params) = golden(case);
    let mut rng = ChaCha8Rng::seed_from_u64(23);
    let steps: Vec<Vec<MicroBatch>> =
        (0..STEPS).map(|_| (0..G).map(|_| micro_batch(&mut rng, spec.vocab)).collect()).collect();
    let cpu = Cpu;
    let mut single = Streamer::new(&cpu, &spec, params.clone(), config(clip), options(gradients))
        .expect("streamer");
    let backends = vec![&cpu; world];
    let peers: Vec<Box<dyn AllReduce<Cpu>>> = CpuGroup::ranks(world)
        .expect("group")
        .into_iter()
        .map(|p| Box::new(p) as Box<dyn AllReduce<Cpu>>)
        .collect();
    let mut dp =
        DataParallel::new(&backends, peers, &spec, params, config(clip), options(gradients))
            .expect("data parallel");
    let (mut loss_err, mut norm_err) = (0f64, 0f64);
    for (k, micro) in steps.iter().enumerate() {
        let (want, _) = single.step(micro).expect("single step");
        let (got, traffic) = dp.step(micro).expect("parallel step");
        assert_eq!(traffic.len(), world);
        assert_eq!((got.step, got.trained_tokens), (want.step, want.trained_tokens), "step {k}");
        loss_err = loss_err.max((got.loss - want.loss).abs() / want.loss.abs());
        norm_err = norm_err.max((got.grad_norm - want.grad_norm).abs() / want.grad_norm.abs());
    }
    let (a, b) = (dp.finish().expect("finish"), single.finish().expect("finish"));
    [loss_err, norm_err, weight_err(&a, &b)]
}

#[test]
fn one_rank_equals_the_single_streamer_bit_for_bit() {
    for (gradients, clip) in [
        (GradientTier::HostStore, Some(1.0)),
        (GradientTier::HostRing, None),
        (GradientTier::DeviceStore, Some(1.0)),
    ] {
        let errs = compare("llama", 1, gradients, clip);
        assert_eq!(errs, [0.0; 3], "{gradients:?}");
    }
}

/// Two ranks sum their two micro-batches' gradients each and then add the two sums, where the
/// single streamer adds four in a row: f32 rounding of a different association, ~1e-7 of each
/// gradient. Adam divides by sqrt(v), which keeps relative errors of that order in each update,
/// so after 3 steps the weights agree to ~1e-6 of their scale; the losses and norms to ~1e-6.
#[test]
fn two_ranks_agree_with_the_single_streamer() {
    for (case, gradients, clip) in [
        ("llama", GradientTier::HostStore, Some(1.0)),
        ("qwen2", GradientTier::HostRing, None),
        ("llama", GradientTier::DeviceStore, Some(1.0)),
    ] {
        let [loss, norm, weights] = compare(case, 2, gradients, clip);
        println!(
            "{case} {gradients:?}: loss {loss:.2e}, grad norm {norm:.2e}, weights {weights:.2e}"
        );
        assert!(loss <= 1e-5, "{case} {gradients:?}: loss differs by {loss:.2e}");
        assert!(norm <= 1e-5, "{case} {gradients:?}: grad norm differs by {norm:.2e}");
        assert!(weights <= 1e-4, "{case} {gradients:?}: weights differ by {weights:.2e}");
        // Not trivially equal: the ranks really did split the work.
        assert!(loss + norm + weights > 0.0, "{case}: two ranks gave identical bits");
    }
}

#[test]
fn bad_groups_are_errors() {
    let (spec, params) = golden("llama");
    let cpu = Cpu;
    let peers = |n: usize| -> Vec<Box<dyn AllReduce<Cpu>>> {
        CpuGroup::ranks(n).expect("group").into_iter().map(|p| Box::new(p) as _).collect()
    };
    let opts = options(GradientTier::HostStore);
    let build = |backends: &[&Cpu], p, o: ScheduleOptions| {
        DataParallel::new(backends, p, &spec, params.clone(), config(None), o).err()
    };
    let e = build(&[&cpu, &cpu], peers(3), opts.clone()).expect("3 ranks for 2 devices");
    assert!(e.to_string().contains("communicator ranks"), "{e}");
    let few = ScheduleOptions { grad_accum: 1, ..opts.clone() };
    let e = build(&[&cpu, &cpu], peers(2), few).expect("1 micro-batch for 2 devices");
    assert!(e.to_string().contains("at least 2 micro-batches"), "{e}");
    assert!(build(&[], Vec::new(), opts.clone()).is_some());

    let mut dp = DataParallel::new(&[&cpu, &cpu], peers(2), &spec, params, config(None), opts)
        .expect("data parallel");
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let one = vec![micro_batch(&mut rng, spec.vocab)];
    let e = dp.step(&one).expect_err("one micro-batch for two ranks");
    assert!(e.to_string().contains("takes 2 to 4 micro-batches"), "{e}");
}
