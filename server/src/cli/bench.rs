//! `sluice bench adam`: throughput of the fused CPU AdamW against a naive scalar loop of the same
//! math, in the same run, with the memory bandwidth it implies. The optimizer is memory-bound,
//! so the bandwidth figure says how close to the machine's limit it runs.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::Context;
use sluice_engine::optim::{
    AdamPool, AdamW, FusedStep, UnitState, adamw_fused, adamw_fused_scalar, fused_isa,
};
use sluice_engine::store::{HostSlab, Pages, zeroed_f32_vec};

#[derive(Debug, clap::Args)]
pub(crate) struct BenchArgs {
    #[command(subcommand)]
    what: Bench,
}

#[derive(Debug, clap::Subcommand)]
enum Bench {
    /// Fused multi-threaded AdamW (grad, m, v, master in; m, v, master out), with and without
    /// the bf16 streaming copy written, against a naive single-threaded scalar loop.
    Adam(AdamArgs),
    /// Training steps of a random-init (or loaded) model on synthetic tokens: TFLOPS, tokens/s,
    /// time per phase, PCIe traffic, memory, against the planner's prediction.
    Train(Box<super::bench_train::TrainArgs>),
    /// The fused attention kernels alone on the GPU, forward and backward: time and TFLOPS
    /// (causal pairs counted) at a training shape.
    Attention(super::bench_attention::AttentionArgs),
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

    /// Pages for the state: `huge` (transparent huge pages, as the store allocates) or `small`
    /// (4 KiB pages only), to measure what huge pages are worth.
    #[arg(long, default_value = "huge", value_parser = parse_pages)]
    pages: Pages,

    /// Skip the single-threaded scalar baseline (several seconds at 1e9 parameters).
    #[arg(long)]
    no_scalar: bool,
}

fn parse_pages(s: &str) -> Result<Pages, String> {
    match s {
        "huge" => Ok(Pages::Huge),
        "small" => Ok(Pages::Small),
        _ => Err(format!("expected huge or small, got {s:?}")),
    }
}

/// Bytes moved per parameter by one update: grad, m, v, master read (4 each); m, v, master
/// written (4 each).
const BYTES_PER_PARAM: f64 = 4.0 * 4.0 + 3.0 * 4.0;
/// And the bf16 copy written where a plan keeps one (weights streamed from the master need
/// none): 2, with streaming stores that skip reading the line first (the compiler-vectorised
/// body off AVX-512 reads it too, 4 in all).
const COPY_BYTES: f64 = 2.0;

pub(crate) fn run(args: BenchArgs) -> anyhow::Result<()> {
    match args.what {
        Bench::Adam(a) => adam(a),
        Bench::Train(a) => super::bench_train::run(*a),
        Bench::Attention(a) => super::bench_attention::run(a),
    }
}

/// Writes `f(i)` into every element, each thread of `pool` taking one contiguous range, so the
/// pages are first touched by the threads that will update them (on one NUMA node this only
/// spreads the page-fault work; on several it also places each page near its thread).
fn fill<T: Send>(pool: &AdamPool, x: &mut [T], f: impl Fn(usize) -> T + Sync) {
    let per = x.len().div_ceil(pool.threads()).max(1);
    let parts: Vec<_> = x.chunks_mut(per).map(|c| Mutex::new(Some(c))).collect();
    pool.broadcast(|i| {
        let Some(part) = parts.get(i).and_then(|p| p.lock().ok().and_then(|mut p| p.take())) else {
            return;
        };
        for (j, x) in part.iter_mut().enumerate() {
            *x = f(i * per + j);
        }
    });
}

/// Anonymous memory of this process on huge pages, in bytes, where the kernel says.
fn huge_page_bytes() -> Option<u64> {
    let rollup = std::fs::read_to_string("/proc/self/smaps_rollup").ok()?;
    let line = rollup.lines().find(|l| l.starts_with("AnonHugePages:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

fn adam(args: AdamArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.params > 0, "--params must be at least 1");
    anyhow::ensure!(args.iters > 0, "--iters must be at least 1");
    anyhow::ensure!(args.params.checked_mul(18).is_some(), "--params {} is too large", args.params);
    let pool = AdamPool::new(args.threads).context("starting the optimizer pool")?;
    let n = args.params;
    let state_gb = n as f64 * 18.0 / 1e9;
    println!(
        "AdamW on {n} parameters ({state_gb:.2} GB of state), {} threads, {} vector path, {:?} pages",
        pool.threads(),
        fused_isa(),
        args.pages
    );

    // Allocated as the store allocates: master, m and v as vectors, the gradient and the bf16
    // copy as slabs. Values near what training sees.
    let t = Instant::now();
    let mut master = zeroed_f32_vec(n, args.pages);
    let mut m = zeroed_f32_vec(n, args.pages);
    let mut v = zeroed_f32_vec(n, args.pages);
    let mut grad = HostSlab::zeroed_on(n * 4, args.pages)?;
    let mut bf16 = HostSlab::zeroed_on(n * 2, args.pages)?;
    fill(&pool, &mut master, |i| ((i % 4093) as f32 - 2046.0) * 1e-4);
    fill(&pool, grad.as_f32_mut(), |i| ((i % 1997) as f32 - 998.0) * 1e-5);
    fill(&pool, &mut m, |_| 0.0);
    fill(&pool, &mut v, |_| 0.0);
    fill(&pool, bf16.as_u16_mut(), |_| 0);
    let huge = huge_page_bytes()
        .map_or("unknown".to_string(), |b| format!("{:.2} of {state_gb:.2} GB", b as f64 / 1e9));
    println!(
        "allocated and first touched in {:.2} s; on huge pages: {huge}",
        t.elapsed().as_secs_f64()
    );

    let hp = AdamW { lr: 1e-5, weight_decay: 0.01, ..AdamW::default() };
    let everything = 0..n;
    let decayed = std::slice::from_ref(&everything);
    let mut step = 0u64;
    let mut next = || {
        step += 1;
        FusedStep { step, lr: 1e-5, hp, clip_coef: 0.5, decayed }
    };

    // The update with the bf16 copy refreshed, or without one (an empty copy).
    let mut time_fused = |iters: usize, copy: bool| -> anyhow::Result<Vec<Duration>> {
        (0..iters)
            .map(|_| {
                let bf16: &mut [u16] = if copy { bf16.as_u16_mut() } else { &mut [] };
                let state = UnitState { master: &mut master, m: &mut m, v: &mut v, bf16 };
                let t = Instant::now();
                adamw_fused(&pool, state, grad.as_f32(), &next())?;
                Ok(t.elapsed())
            })
            .collect()
    };
    time_fused(1, true)?; // warm-up: thread start-up is not the update's cost
    let fused = super::bench_attention::median(time_fused(args.iters, true)?);
    let fused_master = super::bench_attention::median(time_fused(args.iters, false)?);

    let report = |name: &str, d: Duration, bytes: f64| {
        let rate = n as f64 / d.as_secs_f64();
        println!(
            "{name:<38} {:>8.3} ms  {:>7.3} Gparam/s  {:>7.1} GB/s",
            d.as_secs_f64() * 1e3,
            rate / 1e9,
            rate * bytes / 1e9
        );
        rate
    };
    let threads = pool.threads();
    let copy_bytes = BYTES_PER_PARAM + COPY_BYTES;
    let fast = report(&format!("fused, {threads} threads, bf16 copy"), fused, copy_bytes);
    report(&format!("fused, {threads} threads, no copy"), fused_master, BYTES_PER_PARAM);
    let counts = format!(
        "bandwidth counts {copy_bytes} bytes per parameter with the bf16 copy (a plan whose \
         weights stream from it), {BYTES_PER_PARAM} without (from the fp32 master)"
    );
    if args.no_scalar {
        println!("{counts} (median of {} runs)", args.iters);
        return Ok(());
    }

    let scalar_iters = (args.iters / 3).max(1);
    let mut scalar = Vec::with_capacity(scalar_iters);
    for _ in 0..scalar_iters {
        let state =
            UnitState { master: &mut master, m: &mut m, v: &mut v, bf16: bf16.as_u16_mut() };
        let t = Instant::now();
        adamw_fused_scalar(state, grad.as_f32(), &next())?;
        scalar.push(t.elapsed());
    }
    let slow = report(
        "naive scalar, 1 thread, bf16 copy",
        super::bench_attention::median(scalar),
        copy_bytes,
    );
    println!(
        "speed-up {:.1}x with the copy; {counts} (median of {} and {} runs)",
        fast / slow,
        args.iters,
        scalar_iters
    );
    Ok(())
}
