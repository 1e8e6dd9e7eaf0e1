//! Data parallelism through NCCL against the single-GPU streamer.

use crate::common::*;
use crate::step::{config, golden_dir, random_batch};

/// Data parallelism through NCCL on the golden llama over 3 steps of 4 micro-batches. A
/// communicator of one GPU leaves every gradient as it is, so losses, gradient norms and weights
/// equal the single-GPU streamer's bit for bit, in each gradient tier. With two GPUs or more,
/// two ranks sum two micro-batches each and then add the sums: another association of the f32
/// accumulation (~1e-7), which can flip the last bit of a bf16 streaming weight and so moves
/// later steps by up to a bf16 rounding (~4e-3) of a weight: 1e-3 of the loss, 1e-2 of each
/// unit's weight scale.
#[test]
pub(crate) fn nccl_data_parallel_matches_the_single_gpu_streamer() {
    use sluice_engine::backend::AllReduce;
    use sluice_engine::backend::cuda::nccl::{self, Communicator};
    use sluice_engine::schedule::DataParallel;
    let (path, version) = nccl::library().unwrap_or_else(|e| panic!("{e}"));
    println!("NCCL {version} from {path}");
    let (spec, p) = HostParams::load_dir(&golden_dir("llama")).expect("golden model");
    let steps: Vec<Vec<MicroBatch>> = (0..3)
        .map(|k| (0..4).map(|b| random_batch(spec.vocab, 2, 21, 90 + 4 * k + b)).collect())
        .collect();
    let options = |gradients| ScheduleOptions {
        max_tokens: 42,
        grad_accum: 4,
        checkpoints: CheckpointTier::Host,
        checkpoint_interval: 1,
        optimizer_threads: 4,
        resident: Vec::new(),
        gradients,
        weights: WeightSource::Master,
        ring_slots: RING_SLOTS,
        disk: None,
        kept: Vec::new(),
        kept_attention: Vec::new(),
    };
    let second = match sluice_engine::backend::cuda::probe().expect("GPUs") {
        n if n >= 2 => Some(Cuda::new(1).expect("GPU 1")),
        _ => None,
    };
    let mut groups: Vec<Vec<&Cuda>> = vec![vec![gpu()]];
    if let Some(g1) = &second {
        groups.push(vec![gpu(), g1]);
    }
    for gpus in &groups {
        let world = gpus.len();
        for (gradients, clip) in [
            (GradientTier::HostStore, Some(1.0)),
            (GradientTier::HostRing, None),
            (GradientTier::DeviceStore, Some(1.0)),
        ] {
            let what = format!("NCCL data parallel, {world} GPU(s), {gradients:?}");
            let cfg = TrainConfig { max_grad_norm: clip, ..config() };
            let mut single =
                Streamer::new(gpu(), &spec, p.clone(), cfg.clone(), options(gradients))
                    .expect("streamer");
            let peers: Vec<Box<dyn AllReduce<Cuda>>> = Communicator::local(gpus)
                .expect("communicators")
                .into_iter()
                .map(|c| Box::new(c) as Box<dyn AllReduce<Cuda>>)
                .collect();
            let mut dp = DataParallel::new(gpus, peers, &spec, p.clone(), cfg, options(gradients))
                .expect("data parallel");
            let (loss_tol, weight_tol) = if world == 1 { (0.0, 0.0) } else { (1e-3, 1e-2) };
            for (k, micro) in steps.iter().enumerate() {
                let (want, _) = single.step(micro).expect("single-GPU step");
                let (got, _) = dp.step(micro).expect("data-parallel step");
                for (name, a, b) in
                    [("loss", got.loss, want.loss), ("grad norm", got.grad_norm, want.grad_norm)]
                {
                    assert!(
                        (a - b).abs() <= loss_tol * b.abs(),
                        "{what} step {k}: {name} {a} vs {b}"
                    );
                }
            }
            let (got, want) = (dp.finish().expect("finish"), single.finish().expect("finish"));
            let mut worst = 0f64;
            for (a, b) in got.units.iter().zip(&want.units) {
                worst = worst.max(rel_err(a, b).0);
            }
            assert!(worst <= weight_tol, "{what}: weights differ by {worst:.3e} of their scale");
            println!("{what}: 3 steps, weights differ by {worst:.3e} of their scale");
        }
    }
}
