//! `sluice bench adam`: throughput of the fused CPU AdamW against a naive scalar loop of the same
//! math, in the same run, with the memory bandwidth it implies. The optimizer is memory-bound,
//! so the bandwidth figure says how close to the machine's limit it runs.

use std::time::{Duration, Instant};

use anyhow::Context;
use sluice_engine::optim::{
    AdamPool, AdamW, FusedStep, UnitState, adamw_fused, adamw_fused_scalar, fused_isa,
};

#[derive(Debug, clap::Args)]
pub(crate) struct BenchArgs {
    #[command(subcommand)]
    what: Bench,
}

#[derive(Debug, clap::Subcommand)]
enum Bench {
    /// Fused multi-threaded AdamW (grad, m, v, master in; m, v, master, bf16 copy out) against a
    /// naive single-threaded scalar loop.
    Adam(AdamArgs),
    /// Training steps of a random-init (or loaded) model on synthetic tokens: TFLOPS, tokens/s,
    /// time per phase, PCIe traffic, memory, against the planner's prediction.
    Train(super::bench_train::TrainArgs),
}

#[derive(Debug, clap::Args)]
struct AdamArgs {
    /// Parameters updated per iteration (18 bytes of memory each).
    #[arg(long, default_value_t = 64 << 20)]
    params: usize,

    /// Optimizer threads [default: every logical core].
    #[arg(long, default_value_t = 0)]
    threads: usize,

    /// Timed iterations of the fused update (the scalar loop runs a third as many, at least 1).
    #[arg(long, default_value_t = 10)]
    iters: usize,
}

/// Bytes moved per parameter by one update: grad, m, v, master read (4 each); m, v, master
/// written (4 each) and the bf16 copy written (2).
const BYTES_PER_PARAM: f64 = 4.0 * 4.0 + 3.0 * 4.0 + 2.0;

pub(crate) fn run(args: BenchArgs) -> anyhow::Result<()> {
    match args.what {
        Bench::Adam(a) => adam(a),
        Bench::Train(a) => super::bench_train::run(a),
    }
}

fn adam(args: AdamArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.params > 0, "--params must be at least 1");
    anyhow::ensure!(args.iters > 0, "--iters must be at least 1");
    let pool = AdamPool::new(args.threads).context("starting the optimizer pool")?;
    let n = args.params;
    println!(
        "AdamW on {n} parameters ({:.2} GB of state), {} threads, {} vector path",
        n as f64 * 18.0 / 1e9,
        pool.threads(),
        fused_isa()
    );

    // Values near what training sees; the first touch happens here, on the pool, so the pages
    // are spread the way the update will use them.
    let mut master = vec![0.0f32; n];
    let mut m = vec![0.0f32; n];
    let mut v = vec![0.0f32; n];
    let mut bf16 = vec![0u16; n];
    let grad: Vec<f32> = (0..n).map(|i| ((i % 1997) as f32 - 998.0) * 1e-5).collect();
    for (i, p) in master.iter_mut().enumerate() {
        *p = ((i % 4093) as f32 - 2046.0) * 1e-4;
    }
    let hp = AdamW { lr: 1e-5, weight_decay: 0.01, ..AdamW::default() };
    let everything = 0..n;
    let decayed = std::slice::from_ref(&everything);
    let mut step = 0u64;
    let mut next = || {
        step += 1;
        FusedStep { step, lr: 1e-5, hp, clip_coef: 0.5, decayed }
    };

    let mut time_fused = |iters: usize| -> anyhow::Result<Vec<Duration>> {
        (0..iters)
            .map(|_| {
                let state =
                    UnitState { master: &mut master, m: &mut m, v: &mut v, bf16: &mut bf16 };
                let t = Instant::now();
                adamw_fused(&pool, state, &grad, &next())?;
                Ok(t.elapsed())
            })
            .collect()
    };
    time_fused(1)?; // warm-up: page faults and thread start-up are not the update's cost
    let fused = median(time_fused(args.iters)?);

    let scalar_iters = (args.iters / 3).max(1);
    let mut scalar = Vec::with_capacity(scalar_iters);
    for _ in 0..scalar_iters {
        let state = UnitState { master: &mut master, m: &mut m, v: &mut v, bf16: &mut bf16 };
        let t = Instant::now();
        adamw_fused_scalar(state, &grad, &next())?;
        scalar.push(t.elapsed());
    }
    let scalar = median(scalar);

    let report = |name: &str, d: Duration| {
        let rate = n as f64 / d.as_secs_f64();
        println!(
            "{name:<28} {:>8.3} ms  {:>7.3} Gparam/s  {:>7.1} GB/s",
            d.as_secs_f64() * 1e3,
            rate / 1e9,
            rate * BYTES_PER_PARAM / 1e9
        );
        rate
    };
    let fast = report(&format!("fused, {} threads", pool.threads()), fused);
    let slow = report("naive scalar, 1 thread", scalar);
    println!(
        "speed-up {:.1}x; bandwidth counts {BYTES_PER_PARAM} bytes per parameter (median of {} and {} runs)",
        fast / slow,
        args.iters,
        scalar_iters
    );
    Ok(())
}

fn median(mut times: Vec<Duration>) -> Duration {
    times.sort();
    times.get(times.len() / 2).copied().unwrap_or_default()
}
