//! `sluice bench train`: optimizer steps of the streaming trainer on synthetic tokens, measured
//! phase by phase and set beside the planner's prediction for the same job.
//!
//! The streamer is built directly from freshly initialised (or loaded) weights, which it takes
//! over: one fp32 copy of the model exists, never two. Placement (resident units, checkpoint
//! tier) is the planner's, through the mapping `sluice train` uses.
//!
//! Figures per step: model TFLOPS as `6 x params x tokens / step time` (the figure peers
//! report), the same with causal attention counted, `(6 x params + 6 x layers x hidden x seq)
//! x tokens / step time` (the figure long-context runs are judged by), and the hardware figure
//! with the recompute (the planner's FLOP count of the step: forward, recompute and backward
//! GEMMs plus attention); tokens/s; forward, backward and the tail (norm, clip, hand-off to
//! the optimizer); PCIe bytes and average GB/s each way; device
//! memory (the driver's used memory after the step, and what the streamer allocated); host
//! memory (the store and the process's peak RSS); optimizer time and the part hidden behind
//! device work. With clipping on, the optimizer of step N runs during step N + 1, so each
//! step reports the previous step's updates.
//!
//! With `--check-dir DIR` the first step can be replayed by PyTorch
//! (`scripts/gpu/compare_step.py DIR`): DIR/model holds the initial weights in bf16 (the copies
//! the device computes with), DIR/batches.json the step's micro-batches, DIR/step1.json the loss
//! and every unit's gradient norm before clipping, and DIR/grads every tensor's gradient in f32
//! (the gradients then wait on the device, whose store still holds them after the step, unless
//! `--gradients` says otherwise or the device store does not fit).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use sluice_engine::backend::Backend;
use sluice_engine::backend::cpu::Cpu;
use sluice_engine::backend::cuda::{Cuda, Gap, OpClass, OpProfile, OpTime};
use sluice_engine::data::DatasetSource;
use sluice_engine::data::MicroBatch;
use sluice_engine::model::HostParams;
use sluice_engine::optim::Schedule;
use sluice_engine::plan::{
    BatchShape, Capabilities, GradientTier, MachineRates, Plan, PlanInput, Verdict, plan,
};
use sluice_engine::schedule::from_plan::schedule_options;
use sluice_engine::schedule::{ScheduleOptions, Streamer};
use sluice_engine::spec::ModelSpec;
use sluice_engine::train::{
    GradientPolicy, Job, JobSettings, Limits, ModelSource, TrainConfig, model_spec,
};
use sluice_engine::weights::{
    DEFAULT_MAX_SHARD_BYTES, HfFolder, SaveDtype, TensorRef, save_hf_folder, write_safetensors,
};

use super::device::Device;
use super::shape::ShapeArgs;

#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("source").required(true).args(["model", "preset"])))]
pub(crate) struct TrainArgs {
    #[command(flatten)]
    shape: ShapeArgs,

    /// Keep only the model's first N decoder layers (a reduced-depth shape of a preset, for
    /// checks that must fit a smaller machine; random weights only).
    #[arg(long, value_name = "N")]
    layers: Option<usize>,

    /// Optimizer steps to run; the summary is the median of steps 3..N.
    #[arg(long, default_value_t = 5)]
    steps: usize,

    /// Turn global-norm clipping off (updates then start as gradients land).
    #[arg(long)]
    no_clip: bool,

    /// Train on the same micro-batches every step (the loss must then fall: a quick check that
    /// the updates are right), instead of fresh random tokens.
    #[arg(long)]
    repeat_batch: bool,

    /// Threads of the optimizer [default: every core].
    #[arg(long, default_value_t = 0)]
    optimizer_threads: usize,

    /// Seed of the initialisation and of the synthetic tokens.
    #[arg(long, default_value_t = 0)]
    seed: u64,

    /// Stream the weights from a bf16 copy even where the planner would stream the fp32
    /// master (to measure one against the other).
    #[arg(long)]
    streaming_copy: bool,

    /// Where gradients wait, instead of the most exact place that fits: `device` (fp32, for
    /// the norm), `host` (fp32), `host-bf16` (rounded after the fp32 norm; clipping stays
    /// exact) or `ring` (clipping off: straight to the optimizer).
    #[arg(long, value_enum)]
    gradients: Option<GradientsArg>,

    /// Write the per-step records and the summary to this JSON file.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,

    /// Time every op on the GPU's compute stream (CUDA events around each) and print the
    /// device time per kernel class and op per step, beside the ideal at the planner's rates.
    /// The events cost host time, so profiled steps run slightly slower than unprofiled ones.
    #[arg(long)]
    profile: bool,

    /// Most logits the GPU's chunked cross-entropy holds at once (default 2^28), to measure
    /// the LM head's chunk size; the planner's workspace figure assumes the default.
    #[arg(long, value_name = "N")]
    loss_chunk_logits: Option<usize>,

    /// Write what PyTorch needs to replay step 1 into this folder (see the module docs).
    #[arg(long, value_name = "DIR")]
    check_dir: Option<PathBuf>,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum GradientsArg {
    Device,
    Host,
    HostBf16,
    Ring,
}

impl From<GradientsArg> for GradientTier {
    fn from(g: GradientsArg) -> GradientTier {
        match g {
            GradientsArg::Device => GradientTier::DeviceStore,
            GradientsArg::Host => GradientTier::HostStore,
            GradientsArg::HostBf16 => GradientTier::HostStoreBf16,
            GradientsArg::Ring => GradientTier::HostRing,
        }
    }
}

/// One step's figures.
#[derive(Debug, Clone, serde::Serialize)]
struct Record {
    step: u64,
    loss: f64,
    grad_norm: f64,
    step_s: f64,
    forward_s: f64,
    backward_s: f64,
    /// Norm, clip coefficient and hand-off to the optimizer after the backward.
    tail_s: f64,
    tokens: usize,
    tokens_per_s: f64,
    model_tflops: f64,
    /// `model_tflops` with causal attention's forward and backward added per token.
    attention_tflops: f64,
    hardware_tflops: f64,
    h2d_bytes: u64,
    d2h_bytes: u64,
    h2d_gb_s: f64,
    d2h_gb_s: f64,
    /// Time spent in the weight uploads and gradient landings, from the step's timeline. The
    /// spans are host-side: while the backend queues its copies behind compute and waits for
    /// them, they include that wait, so they bound the copies' time from above.
    h2d_busy_s: f64,
    d2h_busy_s: f64,
    optimizer_s: f64,
    optimizer_exposed_s: f64,
    optimizer_hidden_s: f64,
    /// The disk tier's bytes read and written since the previous step, its rates while busy
    /// (bytes over the I/O thread's time on them) and the optimizer's waits for reads it did
    /// not get ahead of.
    disk_read_bytes: u64,
    disk_write_bytes: u64,
    disk_read_gb_s: f64,
    disk_write_gb_s: f64,
    disk_busy_s: f64,
    disk_waited_s: f64,
    /// Device memory in use after the step (the driver's total less free), if readable.
    gpu_used_bytes: Option<u64>,
    peak_rss_bytes: Option<u64>,
}

pub(crate) fn run(args: TrainArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.steps > 0, "--steps must be at least 1");
    let device = match &args.shape.device {
        Some(d) => {
            let d = Device::one_of(d)?;
            println!("device: {d}");
            d
        }
        None => {
            let (d, why) = Device::detect();
            println!("device: {d} ({why})");
            d
        }
    };
    let source = args.shape.source()?;
    let spec = match (args.layers, &source) {
        (Some(n), ModelSource::Preset(_)) => model_spec(&source)?.with_layers(n)?,
        (Some(_), ModelSource::Dir(_)) => {
            anyhow::bail!("--layers cuts a preset; a model folder trains as it is")
        }
        (None, _) => model_spec(&source)?,
    };
    let job = bench_job(&args, &source, device);
    job.validate(&Limits::ENGINE)?;
    let plan = plan_job(&args, &job, &spec)?;
    let options = schedule_options(&plan, args.optimizer_threads)?;
    print_plan(&plan);
    match device {
        Device::Cpu => bench(&Cpu, None, &args, &spec, &source, &plan, options),
        Device::Cuda(n) => {
            let cuda = Cuda::new(n).context("cannot use the GPU")?;
            if let Some(logits) = args.loss_chunk_logits {
                cuda.set_loss_chunk_logits(logits);
            }
            bench(&cuda, Some(&cuda), &args, &spec, &source, &plan, options)
        }
    }
}

/// The job bench train runs, as `sluice train` would describe it: the flags' model, devices,
/// batch shape, clipping, gradient and moments policies; its data is the synthetic tokens, so
/// the job's data is a name that is never read.
fn bench_job(args: &TrainArgs, source: &ModelSource, device: Device) -> Job {
    let gradients = match args.gradients.map(GradientTier::from) {
        Some(tier) => GradientPolicy::asking_for(tier).unwrap_or_default(),
        None => GradientPolicy::Auto,
    };
    let batch = args.shape.batch();
    Job {
        model: source.clone(),
        data: DatasetSource::File("synthetic tokens".into()),
        eval_data: None,
        devices: device.devices(),
        settings: JobSettings {
            seq_len: batch.seq_len,
            micro_batch: batch.micro_batch,
            grad_accum: batch.grad_accum,
            max_grad_norm: if args.no_clip { 0.0 } else { JobSettings::default().max_grad_norm },
            gradients,
            moments: args.shape.moments.unwrap_or_default(),
            seed: args.seed,
            ..JobSettings::default()
        },
    }
}

/// The planner's verdict for `job` on this machine (what `sluice train` plans, through
/// [`Job::plan_input`]); a refusal prints what `sluice plan` does.
fn plan_job(args: &TrainArgs, job: &Job, spec: &ModelSpec) -> anyhow::Result<Plan> {
    let moments = job.settings.moments;
    let memory = args
        .shape
        .memory(job.devices.gpu_query(), moments)
        .with_context(|| format!("the machine of {}", job.devices))?;
    let mut input = job.plan_input(spec, memory);
    // Measurements the job settings do not express: the bf16 copy where the planner would
    // stream the master, and the ring (which a job asks for by turning clipping off).
    input.supports.master_streaming = !args.streaming_copy;
    if let Some(GradientsArg::Ring) = args.gradients {
        input.supports.only_gradients = Some(GradientTier::HostRing);
    }
    // bench train times GPUs at the GPU's rates whatever device it runs on (the CPU backend
    // has no step-time model).
    input.rates = MachineRates::default();
    // A check writes every tensor's gradient only from the device store (the other tiers reuse
    // their buffers unit after unit): where the planner would put them elsewhere, it is asked
    // for the device store first, and the check falls back to norms only where that does not fit.
    if args.check_dir.is_some() && args.gradients.is_none() && !args.no_clip {
        let device_store = PlanInput {
            supports: Capabilities {
                only_gradients: Some(GradientTier::DeviceStore),
                ..input.supports
            },
            ..input.clone()
        };
        if let Verdict::Fits(p) = plan(&device_store)? {
            println!("check: gradients wait on the device, so every tensor's gradient is written");
            return Ok(*p);
        }
    }
    match plan(&input)? {
        Verdict::Fits(p) => Ok(*p),
        Verdict::Refused(r) => {
            print!("{}", r.details());
            Err(anyhow::anyhow!("does not fit: {r}"))
        }
    }
}

fn print_plan(p: &Plan) {
    let m = &p.model;
    println!(
        "model: {} family, {:.3}B parameters, {} layers, hidden {}, vocab {}{}",
        m.family,
        m.params as f64 / 1e9,
        m.layers,
        m.hidden,
        m.vocab,
        if m.tied_embeddings { ", tied embeddings" } else { "" }
    );
    println!(
        "batch: {} micro-batches x {} rows x {} tokens = {} tokens per step",
        p.batch.grad_accum, p.batch.micro_batch, p.batch.seq_len, p.tokens_per_step
    );
    println!(
        "plan: {} of {} units resident ({}), activations of {} layers kept, attention outputs \
         of {} more, checkpoints {:?}, gradients {:?}, weights from {:?} ({}); device {} of {}, \
         host {} of {}",
        p.placement.resident_units.len(),
        m.units,
        p.placement.resident_summary,
        p.placement.kept_layers.len(),
        p.placement.kept_attention_layers.len(),
        p.placement.checkpoints,
        p.placement.gradients,
        p.placement.weights,
        p.placement.weights_reason,
        gib(p.budget.device.used),
        gib(p.memory.gpu_bytes),
        gib(p.budget.host_used()),
        gib(p.memory.host_bytes),
    );
    if let Some(disk) = p.disk_text() {
        println!("{disk}");
    }
    if p.memory.shared() {
        println!("predicted: no step-time model for the CPU backend (the planner times GPUs)");
        return;
    }
    let t = &p.time;
    println!(
        "predicted: {:.3} s per step, {:.0} TFLOPS ({:.0} with recompute), {:.0} tokens/s; \
         bottleneck {:?}",
        t.total_s,
        t.model_tflops,
        t.flops / t.total_s / 1e12,
        t.tokens_per_s,
        t.bottleneck
    );
}

/// Initialises (or loads) the weights, builds the streamer, runs the steps and reports.
fn bench<B: Backend>(
    b: &B,
    cuda: Option<&Cuda>,
    args: &TrainArgs,
    spec: &ModelSpec,
    source: &ModelSource,
    plan: &Plan,
    options: ScheduleOptions,
) -> anyhow::Result<()> {
    let started = Instant::now();
    let params = match source {
        ModelSource::Dir(dir) => HostParams::load_dir(dir).map(|(_, p)| p)?,
        ModelSource::Preset(_) => HostParams::random(spec, args.seed),
    };
    println!("weights: {:.1} s ({})", started.elapsed().as_secs_f64(), source_name(source));
    if let Some(dir) = &args.check_dir {
        let started = Instant::now();
        write_check_model(dir, spec, &params)?;
        println!(
            "check: initial weights written to {} in {:.1} s",
            dir.join("model").display(),
            started.elapsed().as_secs_f64()
        );
    }
    let config = TrainConfig {
        lr: 1e-5,
        schedule: Schedule::Constant,
        total_steps: args.steps as u64,
        max_grad_norm: (!args.no_clip).then_some(1.0),
        ..TrainConfig::default()
    };
    let started = Instant::now();
    let mut streamer = Streamer::new(b, spec, params, config, options)?;
    let store = streamer.store().bytes();
    println!(
        "streamer: {:.1} s to build; device buffers {}, host store {} (master {}, moments {}, \
         streaming copy {}, gradients {})",
        started.elapsed().as_secs_f64(),
        gib(streamer.device_bytes as u64),
        gib(store.total() as u64),
        gib(store.master as u64),
        gib(store.moments as u64),
        gib(store.streaming as u64),
        gib(store.grads as u64),
    );

    // A mixture of experts' TFLOPS count the experts each token is routed to.
    let params = plan.model.active_params as f64;
    let attention_per_token = 6.0 * (spec.layers * spec.hidden * plan.batch.seq_len) as f64;
    let mut rng = StdRng::seed_from_u64(args.seed ^ 0x5eed_70c5);
    let mut records = Vec::with_capacity(args.steps);
    let first = synthetic_step(&mut rng, spec.vocab, &plan.batch);
    let profiler = cuda.filter(|_| args.profile);
    if let Some(c) = profiler {
        c.set_profiling(true);
    } else if args.profile {
        println!("profile: only the CUDA backend times its ops; --profile ignored");
    }
    let mut profiles = Vec::new();
    let mut last_timeline = Vec::new();
    for step in 1..=args.steps {
        let micro = if step == 1 || args.repeat_batch {
            first.clone()
        } else {
            synthetic_step(&mut rng, spec.vocab, &plan.batch)
        };
        if step == 1
            && let Some(dir) = &args.check_dir
        {
            write_batches(dir, &micro)?;
        }
        let (m, traffic) = streamer.step(&micro)?;
        if let Some(c) = profiler {
            profiles.push(c.take_profile()?);
        }
        if step == 1
            && let Some(dir) = &args.check_dir
        {
            write_step(dir, &mut streamer, m.loss, m.grad_norm, m.trained_tokens)?;
        }
        let t = m.elapsed.as_secs_f64().max(1e-9);
        let busy = |stream: &str| -> f64 {
            m.timeline.iter().filter(|s| s.stream == stream).map(|s| s.end - s.start).sum()
        };
        let gpu_used_bytes = match cuda {
            Some(c) => Some(c.memory().map(|(free, total)| total - free)?),
            None => None,
        };
        let r = Record {
            step: m.step,
            loss: m.loss,
            grad_norm: m.grad_norm,
            step_s: t,
            forward_s: traffic.forward.as_secs_f64(),
            backward_s: traffic.backward.as_secs_f64(),
            tail_s: (m.elapsed - traffic.forward - traffic.backward).as_secs_f64(),
            tokens: m.tokens,
            tokens_per_s: m.tokens as f64 / t,
            model_tflops: 6.0 * params * m.tokens as f64 / t / 1e12,
            attention_tflops: (6.0 * params + attention_per_token) * m.tokens as f64 / t / 1e12,
            hardware_tflops: plan.time.flops / t / 1e12,
            h2d_bytes: m.h2d_bytes,
            d2h_bytes: m.d2h_bytes,
            h2d_gb_s: m.h2d_bytes as f64 / t / 1e9,
            d2h_gb_s: m.d2h_bytes as f64 / t / 1e9,
            h2d_busy_s: busy("h2d"),
            d2h_busy_s: busy("d2h"),
            optimizer_s: m.optimizer_time.as_secs_f64(),
            optimizer_exposed_s: m.optimizer_exposed.as_secs_f64(),
            optimizer_hidden_s: m.optimizer_time.saturating_sub(m.optimizer_exposed).as_secs_f64(),
            disk_read_bytes: traffic.disk.read_bytes,
            disk_write_bytes: traffic.disk.write_bytes,
            disk_read_gb_s: rate(traffic.disk.read_bytes, traffic.disk.read_busy),
            disk_write_gb_s: rate(traffic.disk.write_bytes, traffic.disk.write_busy),
            disk_busy_s: (traffic.disk.read_busy + traffic.disk.write_busy).as_secs_f64(),
            disk_waited_s: traffic.disk.waited.as_secs_f64(),
            gpu_used_bytes,
            peak_rss_bytes: peak_rss(),
        };
        print_record(&r);
        records.push(r);
        last_timeline = m.timeline;
    }
    // Dropping the streamer waits for the last step's updates (the optimizer worker finishes
    // its queue) and frees everything; `finish` would also copy the master weights out. (An
    // error in those last updates goes unreported: nothing reads the weights they make.)
    let device_bytes = streamer.device_bytes as u64;
    let started = Instant::now();
    drop(streamer);
    let drain = started.elapsed();

    let mut summary = summarise(&records, plan, device_bytes, store.total() as u64);
    print_summary(&summary, drain);
    if let Some(c) = profiler {
        c.set_profiling(false);
        let steady = if profiles.len() >= 3 { &profiles[2..] } else { &profiles[..] };
        let table = profile_table(steady, &records, plan);
        print_profile(&table);
        summary["profile"] = table;
    }
    if let Some(path) = &args.json {
        let report = json!({
            "device": b.name(),
            "plan": plan,
            "steps": records,
            "summary": summary,
            "last_step_timeline": last_timeline,
            "last_updates_and_teardown_s": drain.as_secs_f64(),
        });
        let text = serde_json::to_string_pretty(&report)?;
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
        println!("records: {}", path.display());
    }
    Ok(())
}

/// Attention's ideal in the profile: what a Hopper-tuned kernel reaches on the H200 (torch's
/// SDPA measured about 490 TFLOPS at seq 4096 and 580 at 16384, forward and backward), not the
/// planner's rate, which is what Sluice's kernels measured.
const IDEAL_ATTENTION_FLOPS: f64 = 450e12;

/// Pairs of consecutive ops the profile lists the stream's idle time between, longest first.
const PROFILE_GAPS: usize = 10;

/// The mean per step of `profiles` (steps 3..N), per class and op, with the ideal time of the
/// counted FLOPs and of the step's PCIe bytes at the planner's rates.
fn profile_table(profiles: &[OpProfile], records: &[Record], plan: &Plan) -> Value {
    let n = profiles.len().max(1) as f64;
    let steady = if records.len() >= 3 { &records[2..] } else { records };
    let mean =
        |f: fn(&Record) -> f64| steady.iter().map(f).sum::<f64>() / steady.len().max(1) as f64;
    let rates = MachineRates::default();
    let mut ops: Vec<OpTime> = Vec::new();
    for p in profiles {
        for o in &p.ops {
            match ops.iter_mut().find(|x| x.op == o.op) {
                Some(x) => {
                    x.calls += o.calls;
                    x.seconds += o.seconds;
                    x.flops += o.flops;
                }
                None => ops.push(o.clone()),
            }
        }
    }
    let mut gaps: Vec<Gap> = Vec::new();
    for g in profiles.iter().flat_map(|p| &p.gaps) {
        match gaps.iter_mut().find(|x| x.after == g.after && x.before == g.before) {
            Some(x) => {
                x.count += g.count;
                x.seconds += g.seconds;
                x.longest = x.longest.max(g.longest);
            }
            None => gaps.push(g.clone()),
        }
    }
    gaps.sort_by(|a, b| b.seconds.total_cmp(&a.seconds));
    let gaps: Vec<Value> = gaps
        .iter()
        .take(PROFILE_GAPS)
        .map(|g| {
            json!({
                "after": g.after,
                "before": g.before,
                "count": g.count as f64 / n,
                "seconds": g.seconds / n,
                "longest_s": g.longest,
            })
        })
        .collect();
    let merged =
        OpProfile { ops, window_s: profiles.iter().map(|p| p.window_s).sum(), gaps: vec![] };
    let classes: Vec<Value> = merged
        .classes()
        .into_iter()
        .map(|(class, calls, seconds, flops)| {
            let ops: Vec<Value> = merged
                .ops
                .iter()
                .filter(|o| o.class == class)
                .map(|o| {
                    json!({
                        "op": o.op,
                        "calls": o.calls as f64 / n,
                        "seconds": o.seconds / n,
                        "tflops": (o.flops > 0.0).then(|| o.flops / o.seconds.max(1e-12) / 1e12),
                    })
                })
                .collect();
            let ideal = match class {
                OpClass::Gemm | OpClass::Loss => Some(flops / n / rates.gemm_flops),
                OpClass::Attention => Some(flops / n / IDEAL_ATTENTION_FLOPS),
                _ => None,
            };
            json!({
                "class": class,
                "calls": calls as f64 / n,
                "seconds": seconds / n,
                "tflops": (flops > 0.0).then(|| flops / seconds.max(1e-12) / 1e12),
                "ideal_seconds": ideal,
                "ops": ops,
            })
        })
        .collect();
    let step_s = mean(|r| r.step_s);
    json!({
        "steps": profiles.len(),
        "classes": classes,
        "busy_s": merged.busy_s() / n,
        "window_s": merged.window_s / n,
        "step_s": step_s,
        "predicted_step_s": plan.time.total_s,
        "h2d_ideal_s": mean(|r| r.h2d_bytes as f64) / rates.pcie_h2d,
        "d2h_ideal_s": mean(|r| r.d2h_bytes as f64) / rates.pcie_d2h,
        "gaps": gaps,
        "gemm_rate": rates.gemm_flops,
        "attention_rate": IDEAL_ATTENTION_FLOPS,
        "pcie_rate": rates.pcie_h2d,
    })
}

fn print_profile(t: &Value) {
    let f = |v: &Value| v.as_f64().unwrap_or(f64::NAN);
    let step = f(&t["step_s"]);
    println!(
        "profile (device time per step on the compute stream, mean of {} profiled steps; ideal \
         at {:.0} TFLOPS for GEMMs and the LM head, {:.0} for attention):",
        t["steps"],
        f(&t["gemm_rate"]) / 1e12,
        f(&t["attention_rate"]) / 1e12,
    );
    println!(
        "  {:<28} {:>9} {:>9} {:>7} {:>8} {:>9}",
        "class / op", "calls", "s", "share", "TFLOPS", "ideal s"
    );
    let opt = |v: &Value, w: usize, p: usize| match v.as_f64() {
        Some(x) => format!("{x:>w$.p$}"),
        None => format!("{:>w$}", "-"),
    };
    // A class's row, then its ops' indented below it (they have no ideal of their own).
    let row = |indent: usize, name: &Value, r: &Value| {
        println!(
            "  {:indent$}{:<w$} {:>9.0} {:>9.3} {:>6.1}% {} {}",
            "",
            name.as_str().unwrap_or("?"),
            f(&r["calls"]),
            f(&r["seconds"]),
            100.0 * f(&r["seconds"]) / step,
            opt(&r["tflops"], 8, 1),
            if indent == 0 { opt(&r["ideal_seconds"], 9, 3) } else { String::new() },
            w = 28 - indent,
        );
    };
    for c in t["classes"].as_array().into_iter().flatten() {
        row(0, &c["class"], c);
        for o in c["ops"].as_array().into_iter().flatten() {
            row(2, &o["op"], o);
        }
    }
    let (busy, window) = (f(&t["busy_s"]), f(&t["window_s"]));
    println!(
        "  ops {busy:.3} s of a {window:.3} s window on the compute stream ({:.3} s between ops: \
         waits for transfers and the host); step {step:.3} s (planner {:.3} s); PCIe ideal {:.3} s \
         up, {:.3} s down",
        window - busy,
        f(&t["predicted_step_s"]),
        f(&t["h2d_ideal_s"]),
        f(&t["d2h_ideal_s"]),
    );
    println!("  longest idle time between ops, per step:");
    for g in t["gaps"].as_array().into_iter().flatten() {
        println!(
            "    {:>7.3} s in {:>5.0} gaps (longest {:.2} ms) after {} before {}",
            f(&g["seconds"]),
            f(&g["count"]),
            f(&g["longest_s"]) * 1e3,
            g["after"].as_str().unwrap_or("?"),
            g["before"].as_str().unwrap_or("?"),
        );
    }
}

/// Gigabytes per second of `bytes` moved in `busy` (0 when nothing moved).
fn rate(bytes: u64, busy: Duration) -> f64 {
    if bytes == 0 { 0.0 } else { bytes as f64 / busy.as_secs_f64().max(1e-9) / 1e9 }
}

fn source_name(source: &ModelSource) -> String {
    match source {
        ModelSource::Dir(dir) => format!("loaded from {}", dir.display()),
        ModelSource::Preset(name) => format!("random init of {name}"),
    }
}

/// G micro-batches of `rows x seq_len` uniformly random tokens, one document per row, every
/// position trained on the next token (each row draws `seq_len + 1` tokens).
fn synthetic_step(rng: &mut StdRng, vocab: usize, batch: &BatchShape) -> Vec<MicroBatch> {
    let (rows, s) = (batch.micro_batch, batch.seq_len);
    let vocab = i32::try_from(vocab).unwrap_or(i32::MAX);
    (0..batch.grad_accum)
        .map(|_| {
            let mut mb = MicroBatch {
                rows,
                seq_len: s,
                ids: Vec::with_capacity(rows * s),
                targets: Vec::with_capacity(rows * s),
                positions: Vec::with_capacity(rows * s),
                cu_seqlens: (0..=rows).map(|r| (r * s) as i32).collect(),
            };
            for _ in 0..rows {
                let row: Vec<i32> = (0..=s).map(|_| rng.random_range(0..vocab)).collect();
                mb.ids.extend_from_slice(&row[..s]);
                mb.targets.extend_from_slice(&row[1..]);
                mb.positions.extend((0..s).map(|p| p as i32));
            }
            mb
        })
        .collect()
}

fn print_record(r: &Record) {
    let mut line = format!(
        "step {:>3}  loss {:.4}  norm {:.3}  {:.3} s (fwd {:.3}, bwd {:.3}, tail {:.3})  \
         {:.1} TFLOPS ({:.1} with recompute)  {:.0} tokens/s  h2d {:.2} GB/s, d2h {:.2} GB/s  \
         optimizer {:.3} s ({:.3} s exposed)",
        r.step,
        r.loss,
        r.grad_norm,
        r.step_s,
        r.forward_s,
        r.backward_s,
        r.tail_s,
        r.model_tflops,
        r.hardware_tflops,
        r.tokens_per_s,
        r.h2d_gb_s,
        r.d2h_gb_s,
        r.optimizer_s,
        r.optimizer_exposed_s,
    );
    if r.disk_read_bytes + r.disk_write_bytes > 0 {
        line += &format!(
            "  disk read {} at {:.2} GB/s, wrote {} at {:.2} GB/s, optimizer waited {:.3} s",
            gib(r.disk_read_bytes),
            r.disk_read_gb_s,
            gib(r.disk_write_bytes),
            r.disk_write_gb_s,
            r.disk_waited_s,
        );
    }
    if let Some(used) = r.gpu_used_bytes {
        line += &format!("  GPU {} used", gib(used));
    }
    if let Some(rss) = r.peak_rss_bytes {
        line += &format!("  peak RSS {}", gib(rss));
    }
    println!("{line}");
}

/// Medians over steps 3..N (all steps when there are fewer than three), peaks over all steps.
fn summarise(records: &[Record], plan: &Plan, device_bytes: u64, store_bytes: u64) -> Value {
    let steady = if records.len() >= 3 { &records[2..] } else { records };
    let median = |f: fn(&Record) -> f64| -> f64 {
        let mut v: Vec<f64> = steady.iter().map(f).collect();
        v.sort_by(f64::total_cmp);
        match v.len() {
            0 => f64::NAN,
            n if n % 2 == 1 => v[n / 2],
            n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
        }
    };
    let step_s = median(|r| r.step_s);
    let optimizer_s = median(|r| r.optimizer_s);
    let hidden_s = median(|r| r.optimizer_hidden_s);
    let mut summary = json!({
        "steps": if records.len() >= 3 { format!("3..{}", records.len()) }
                 else { format!("1..{} (fewer than 3 steps)", records.len()) },
        "step_s": step_s,
        "forward_s": median(|r| r.forward_s),
        "backward_s": median(|r| r.backward_s),
        "tail_s": median(|r| r.tail_s),
        "tokens_per_s": median(|r| r.tokens_per_s),
        "model_tflops": median(|r| r.model_tflops),
        "attention_tflops": median(|r| r.attention_tflops),
        "hardware_tflops": median(|r| r.hardware_tflops),
        "h2d_gb_s": median(|r| r.h2d_gb_s),
        "d2h_gb_s": median(|r| r.d2h_gb_s),
        "h2d_busy_s": median(|r| r.h2d_busy_s),
        "d2h_busy_s": median(|r| r.d2h_busy_s),
        "optimizer_s": optimizer_s,
        "optimizer_hidden_s": hidden_s,
        "optimizer_hidden_fraction": if optimizer_s > 0.0 { hidden_s / optimizer_s } else { f64::NAN },
        "disk_read_gb_s": median(|r| r.disk_read_gb_s),
        "disk_write_gb_s": median(|r| r.disk_write_gb_s),
        "disk_busy_s": median(|r| r.disk_busy_s),
        "disk_waited_s": median(|r| r.disk_waited_s),
        "peak_gpu_used_bytes": records.iter().filter_map(|r| r.gpu_used_bytes).max(),
        "streamer_device_bytes": device_bytes,
        "planned_device_bytes": plan.budget.device.used,
        "host_store_bytes": store_bytes,
        "planned_host_bytes": plan.budget.host_used(),
        "peak_rss_bytes": records.iter().filter_map(|r| r.peak_rss_bytes).max(),
        "weights": plan.placement.weights,
    });
    // Everything the process holds, over what it trains: the figure to compare with the
    // planner's bytes per parameter.
    if let Some(rss) = summary["peak_rss_bytes"].as_u64() {
        summary["host_bytes_per_param"] = json!(rss as f64 / plan.model.params as f64);
    }
    if !plan.memory.shared() {
        summary["predicted_step_s"] = json!(plan.time.total_s);
        summary["predicted_bottleneck"] = json!(plan.time.bottleneck);
        summary["measured_over_predicted"] = json!(step_s / plan.time.total_s);
    }
    summary
}

fn print_summary(s: &Value, drain: Duration) {
    let f = |k: &str| s[k].as_f64().unwrap_or(f64::NAN);
    let bytes = |k: &str| s[k].as_u64().map_or_else(|| "n/a".to_string(), gib);
    println!(
        "summary (median of steps {}): {:.3} s per step, {:.1} TFLOPS by 6 x params x tokens \
         ({:.1} with causal attention counted, {:.1} with recompute), {:.0} tokens/s; \
         forward {:.3} s, backward {:.3} s, tail {:.3} s; PCIe h2d {:.2} GB/s, d2h {:.2} GB/s; \
         optimizer {:.3} s, {:.0}% hidden",
        s["steps"].as_str().unwrap_or("?"),
        f("step_s"),
        f("model_tflops"),
        f("attention_tflops"),
        f("hardware_tflops"),
        f("tokens_per_s"),
        f("forward_s"),
        f("backward_s"),
        f("tail_s"),
        f("h2d_gb_s"),
        f("d2h_gb_s"),
        f("optimizer_s"),
        100.0 * f("optimizer_hidden_fraction"),
    );
    println!(
        "memory: GPU peak {} used (driver), streamer {} allocated, planned {}; host store {}, \
         planned {}, peak RSS {} ({:.2} bytes per parameter); last updates and teardown {:.3} s",
        bytes("peak_gpu_used_bytes"),
        bytes("streamer_device_bytes"),
        bytes("planned_device_bytes"),
        bytes("host_store_bytes"),
        bytes("planned_host_bytes"),
        bytes("peak_rss_bytes"),
        f("host_bytes_per_param"),
        drain.as_secs_f64(),
    );
    if f("disk_busy_s") > 0.0 {
        // Reads and writes run on their own threads and may overlap, so their busy times are
        // given apart; the optimizer's waits are the disk time the schedule did not hide.
        println!(
            "disk tier: reads {:.2} GB/s, writes {:.2} GB/s while busy (reads and writes may \
             overlap: {:.3} s busy per step counted apart); the optimizer waited {:.3} s per \
             step for reads",
            f("disk_read_gb_s"),
            f("disk_write_gb_s"),
            f("disk_busy_s"),
            f("disk_waited_s"),
        );
    }
    if s["predicted_step_s"].is_null() {
        return;
    }
    println!(
        "planner: {:.3} s per step predicted (bottleneck {}); measured / predicted = {:.2}",
        f("predicted_step_s"),
        s["predicted_bottleneck"].as_str().unwrap_or("?"),
        f("measured_over_predicted"),
    );
}

/// The initial weights as a Hugging Face folder in bf16: the round-to-nearest-even copies the
/// host store streams to the device, so PyTorch computes with the same values.
fn write_check_model(dir: &Path, spec: &ModelSpec, params: &HostParams) -> anyhow::Result<()> {
    let folder = HfFolder {
        tensors: params.tensor_refs(),
        dtype: SaveDtype::Bf16,
        max_shard_bytes: DEFAULT_MAX_SHARD_BYTES,
        config: spec.to_hf_config(),
        extra_files: Vec::new(),
    };
    save_hf_folder(dir.join("model"), &folder)?;
    Ok(())
}

/// The first step's micro-batches: `[rows, seq_len]` ids, targets and positions each.
fn write_batches(dir: &Path, micro: &[MicroBatch]) -> anyhow::Result<()> {
    let batches: Vec<Value> = micro
        .iter()
        .map(|mb| {
            json!({
                "rows": mb.rows,
                "seq_len": mb.seq_len,
                "ids": mb.ids,
                "targets": mb.targets,
                "positions": mb.positions,
            })
        })
        .collect();
    let path = dir.join("batches.json");
    std::fs::write(&path, serde_json::to_vec(&json!({ "micro_batches": batches }))?)
        .with_context(|| format!("writing {}", path.display()))
}

/// The first step's loss and every unit's gradient norm before clipping, with the tensors each
/// unit holds (a tied LM head's gradient is part of the embedding's); where the device store
/// still holds them, every tensor's gradient too, in f32, one folder per unit
/// (`grads/<unit>/model.safetensors`, so no more than one unit is in host memory at once).
fn write_step<B: Backend>(
    dir: &Path,
    streamer: &mut Streamer<'_, B>,
    loss: f64,
    grad_norm: f64,
    trained_tokens: usize,
) -> anyhow::Result<()> {
    let spec = streamer.spec().clone();
    let layout = sluice_engine::model::ModelLayout::new(&spec);
    let gradients = match write_gradients(dir, streamer, &layout) {
        Ok(()) => Some("grads"),
        Err(e) => {
            println!("check: per-tensor gradients not written ({e:#}); norms only");
            None
        }
    };
    let norms = streamer.grad_norms();
    let mut units = Vec::new();
    for (unit, &norm) in layout.units.iter().zip(&norms) {
        let name = match unit.kind {
            sluice_engine::model::UnitKind::Embedding => "embedding".to_string(),
            sluice_engine::model::UnitKind::Layer(l) => format!("layer {l}"),
            sluice_engine::model::UnitKind::Head => "head".to_string(),
        };
        let tensors: Vec<&str> = unit.tensors.iter().map(|t| t.name.as_str()).collect();
        units.push(json!({ "name": name, "tensors": tensors, "grad_norm": norm }));
    }
    let report = json!({
        "loss": loss,
        "grad_norm": grad_norm,
        "trained_tokens": trained_tokens,
        "tied_embeddings": spec.tie_embeddings,
        "units": units,
        "gradients": gradients,
    });
    let path = dir.join("step1.json");
    std::fs::write(&path, serde_json::to_vec_pretty(&report)?)
        .with_context(|| format!("writing {}", path.display()))
}

/// Every unit's step-1 gradients as f32 safetensors under `dir/grads/<unit>/`.
fn write_gradients<B: Backend>(
    dir: &Path,
    streamer: &mut Streamer<'_, B>,
    layout: &sluice_engine::model::ModelLayout,
) -> anyhow::Result<()> {
    let started = Instant::now();
    for (u, unit) in layout.units.iter().enumerate() {
        let grads = streamer.stored_gradients(u)?;
        let tensors: Vec<TensorRef<'_>> = unit
            .tensors
            .iter()
            .map(|t| TensorRef {
                name: &t.name,
                shape: t.shape.clone(),
                data: grads[t.range.clone()].into(),
            })
            .collect();
        let folder = dir.join("grads").join(format!("{u:04}"));
        std::fs::create_dir_all(&folder)
            .with_context(|| format!("creating {}", folder.display()))?;
        write_safetensors(&folder, &tensors, SaveDtype::F32, usize::MAX)?;
    }
    println!(
        "check: every tensor's gradient written to {} in {:.1} s",
        dir.join("grads").display(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// VmHWM from `/proc/self/status`: the process's peak resident memory, in bytes.
fn peak_rss() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

fn gib(bytes: u64) -> String {
    format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
}
