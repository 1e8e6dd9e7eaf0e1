//! `sluice train`: fine-tune a model folder (or train a random-init preset) on a dataset from
//! the terminal, with a progress bar and one line per step.

use std::path::PathBuf;

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use sluice_engine::backend::AllReduce;
use sluice_engine::backend::cpu::Cpu;
use sluice_engine::backend::cuda::Cuda;
use sluice_engine::backend::cuda::nccl::Communicator;
use sluice_engine::data::DatasetSource;
use sluice_engine::optim::Schedule;
use sluice_engine::plan::{
    BatchShape, CheckpointTier, MachineMemory, MachineRates, Plan, PlanInput, Verdict, plan,
};
use sluice_engine::schedule::Tier;
use sluice_engine::schedule::from_plan::{STREAMER, schedule_options};
use sluice_engine::train::{
    Event, ModelSource, Observer, RunOptions, TrainConfig, model_spec, read_run_options,
};
use sluice_engine::weights::SaveDtype;

use super::device::Device;

#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("source").required(true).args(["model", "preset", "resume"])))]
pub(crate) struct TrainArgs {
    /// Continue the run in this folder exactly where its last saved state left it, with the
    /// options it was started with (no other option may be given).
    #[arg(long, value_name = "OUT", conflicts_with_all = [
        "model", "preset", "data", "dataset", "out", "steps", "seq_len", "micro_batch", "grad_accum",
        "lr", "schedule", "warmup", "weight_decay", "max_grad_norm", "seed", "train_on_prompt",
        "save_every", "save_dtype", "eval_every", "eval_data",
    ])]
    resume: Option<PathBuf>,

    /// Hugging Face model folder (config.json, safetensors weights, tokenizer.json).
    #[arg(long, value_name = "DIR")]
    model: Option<PathBuf>,

    /// Random-init model shape instead of a folder: tiny, qwen2.5-0.5b, qwen2.5-7b, llama3-8b, ...
    #[arg(long, value_name = "NAME")]
    preset: Option<String>,

    /// Dataset: JSON Lines or JSON (alpaca, sharegpt, messages, prompt/completion, text), or a
    /// LLaMA-Factory dataset_info.json together with --dataset.
    #[arg(long, value_name = "FILE", required_unless_present = "resume")]
    data: Option<PathBuf>,

    /// Dataset name inside a dataset_info.json registry.
    #[arg(long, value_name = "NAME")]
    dataset: Option<String>,

    /// Run folder; checkpoints go to OUT/checkpoint-<step> and OUT/final [default: runs/<model>].
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,

    /// Optimizer steps [default: one pass over the data].
    #[arg(long)]
    steps: Option<u64>,

    /// Tokens per packed row.
    #[arg(long, default_value_t = 256)]
    seq_len: usize,

    /// Rows per micro-batch.
    #[arg(long, default_value_t = 4)]
    micro_batch: usize,

    /// Micro-batches per optimizer step.
    #[arg(long, default_value_t = 1)]
    grad_accum: usize,

    /// Peak learning rate [default: 2e-5 for a model folder, 1e-3 for a random-init preset].
    #[arg(long)]
    lr: Option<f32>,

    /// Learning-rate schedule after warmup: constant, linear or cosine.
    #[arg(long, default_value = "cosine")]
    schedule: Schedule,

    /// Linear warmup steps.
    #[arg(long, default_value_t = 0)]
    warmup: u64,

    /// AdamW weight decay (matrices only).
    #[arg(long, default_value_t = 0.0)]
    weight_decay: f32,

    /// Clip the global gradient norm to this; 0 turns clipping off.
    #[arg(long, default_value_t = 1.0)]
    max_grad_norm: f32,

    /// Seed for initialisation and data order.
    #[arg(long, default_value_t = 0)]
    seed: u64,

    /// Compute the loss on prompt tokens too, not only on assistant turns.
    #[arg(long)]
    train_on_prompt: bool,

    /// Also save a checkpoint every N steps.
    #[arg(long, value_name = "N")]
    save_every: Option<u64>,

    /// Precision of saved weights: f32 (the exact master weights) or bf16 (half the size).
    #[arg(long, default_value = "f32", value_parser = ["f32", "bf16"])]
    save_dtype: String,

    /// Hold out the last twentieth of the data and report its loss every N steps.
    #[arg(long, value_name = "N")]
    eval_every: Option<u64>,

    /// Evaluate on this held-out dataset (same formats as --data) instead of the data's tail:
    /// its loss before the first step, every --eval-every steps and after the last.
    #[arg(long, value_name = "FILE")]
    eval_data: Option<PathBuf>,

    /// Device to train on: cpu, or cuda / cuda:N for an NVIDIA GPU, or cuda:0,1,... for several
    /// GPUs of this host sharing each step's micro-batches (data parallelism through NCCL;
    /// --grad-accum must be at least the number of GPUs).
    #[arg(long, default_value = "cpu")]
    device: String,

    /// GPU memory the job may use, in bytes [default: the GPU's free memory, from the driver].
    #[arg(long, value_name = "BYTES")]
    gpu_mem: Option<u64>,

    /// Host memory the job may use, in bytes [default: MemAvailable from /proc/meminfo].
    #[arg(long, value_name = "BYTES")]
    host_mem: Option<u64>,
}

pub(crate) fn run(args: TrainArgs) -> anyhow::Result<()> {
    let (gpu_mem, host_mem) = (args.gpu_mem, args.host_mem);
    let ordinals = gpu_ordinals(&args.device)?;
    // The plan is each GPU's: the first one's memory, its share of the micro-batches.
    let device = ordinals.first().map_or(Device::Cpu, |&o| Device::Cuda(o));
    let (mut options, resume) = match &args.resume {
        Some(out) => (read_run_options(out).context("cannot resume")?, true),
        None => (options(args)?, false),
    };
    // The planner decides where everything lives, and refuses a job that cannot fit, before
    // anything is loaded or allocated.
    options.validate()?;
    let plan = plan_run(&options, device, ordinals.len().max(1), gpu_mem, host_mem)?;
    let schedule = schedule_options(&plan, 0)?;
    options.checkpoints = schedule.checkpoints;
    options.checkpoint_interval = schedule.checkpoint_interval;
    options.resident = schedule.resident;
    options.gradients = Some(schedule.gradients);
    print_plan(&plan, device);
    let mut printer = Printer { bar: None };
    let summary = match ordinals.as_slice() {
        [] => sluice_engine::train::run(&Cpu, &options, resume, &mut printer),
        &[ordinal] => {
            let cuda = Cuda::new(ordinal).context("cannot use the GPU")?;
            sluice_engine::train::run(&cuda, &options, resume, &mut printer)
        }
        ordinals => {
            let gpus = ordinals
                .iter()
                .map(|&o| Cuda::new(o).with_context(|| format!("cannot use GPU {o}")))
                .collect::<anyhow::Result<Vec<_>>>()?;
            let refs: Vec<&Cuda> = gpus.iter().collect();
            let peers: Vec<Box<dyn AllReduce<Cuda>>> = Communicator::local(&refs)
                .context("cannot link the GPUs through NCCL")?
                .into_iter()
                .map(|c| Box::new(c) as Box<dyn AllReduce<Cuda>>)
                .collect();
            sluice_engine::train::run_parallel(&refs, peers, &options, resume, &mut printer)
        }
    }
    .context("training failed")?;
    if let Some(bar) = printer.bar.take() {
        bar.finish_and_clear();
    }
    println!(
        "done: {} steps, loss {:.4} -> {:.4}; checkpoint in {}",
        summary.steps,
        summary.first_loss,
        summary.last_loss,
        summary.final_checkpoint.display()
    );
    Ok(())
}

/// The GPUs `--device` names: none for `cpu`, one for `cuda` or `cuda:N`, several for
/// `cuda:0,1,...` (distinct).
fn gpu_ordinals(device: &str) -> anyhow::Result<Vec<usize>> {
    let expected = || format!("--device {device}: expected cpu, cuda, cuda:N or cuda:N,M,...");
    if device == "cpu" {
        return Ok(Vec::new());
    }
    let list = match device.strip_prefix("cuda") {
        Some("") => return Ok(vec![0]),
        Some(rest) => rest.strip_prefix(':').with_context(expected)?,
        None => anyhow::bail!(expected()),
    };
    let mut ordinals = Vec::new();
    for n in list.split(',') {
        let o: usize = n.trim().parse().with_context(expected)?;
        if ordinals.contains(&o) {
            anyhow::bail!("--device {device}: GPU {o} is named twice");
        }
        ordinals.push(o);
    }
    Ok(ordinals)
}

/// The run's options from the command line.
fn options(args: TrainArgs) -> anyhow::Result<RunOptions> {
    let (model, default_out, default_lr) = match (&args.model, &args.preset) {
        (Some(dir), _) => {
            let name = dir.file_name().map_or("model".into(), |n| n.to_string_lossy().into_owned());
            (ModelSource::Dir(dir.clone()), name, 2e-5)
        }
        (None, Some(name)) => (ModelSource::Preset(name.clone()), name.clone(), 1e-3),
        (None, None) => anyhow::bail!("give --model DIR, --preset NAME or --resume OUT"),
    };
    let Some(data) = args.data.clone() else { anyhow::bail!("give --data FILE") };
    let data = match &args.dataset {
        Some(name) => DatasetSource::Registry { registry: data, name: name.clone() },
        None => DatasetSource::File(data),
    };
    Ok(RunOptions {
        model,
        data,
        out: args.out.unwrap_or_else(|| PathBuf::from("runs").join(default_out)),
        seq_len: args.seq_len,
        micro_batch: args.micro_batch,
        grad_accum: args.grad_accum,
        steps: args.steps,
        train: TrainConfig {
            lr: args.lr.unwrap_or(default_lr),
            schedule: args.schedule,
            warmup_steps: args.warmup,
            weight_decay: args.weight_decay,
            max_grad_norm: (args.max_grad_norm > 0.0).then_some(args.max_grad_norm),
            ..TrainConfig::default()
        },
        seed: args.seed,
        train_on_prompt: args.train_on_prompt,
        save_every: args.save_every,
        save_dtype: if args.save_dtype == "bf16" { SaveDtype::Bf16 } else { SaveDtype::F32 },
        // Both are the planner's choice, set once the run is planned.
        checkpoints: Tier::Device,
        checkpoint_interval: 1,
        resident: Vec::new(),
        gradients: None,
        eval_every: args.eval_every,
        eval_data: args.eval_data.map(DatasetSource::File),
    })
}

/// Plans the run on this machine (or the memory given) with what the streamer implements; a
/// job that does not fit is an error carrying the planner's reason and what would fit, after
/// the same details `sluice plan` prints.
fn plan_run(
    options: &RunOptions,
    device: Device,
    gpus: usize,
    gpu_mem: Option<u64>,
    host_mem: Option<u64>,
) -> anyhow::Result<Plan> {
    let spec = model_spec(&options.model)?;
    let memory = MachineMemory::detect(device.gpu_query(), gpu_mem, host_mem)
        .with_context(|| format!("reading the memory of {device}"))?;
    let input = PlanInput {
        spec: &spec,
        batch: BatchShape {
            seq_len: options.seq_len,
            micro_batch: options.micro_batch,
            grad_accum: options.grad_accum,
        },
        clipping: options.train.max_grad_norm.is_some(),
        memory,
        rates: MachineRates::default(),
        supports: STREAMER,
        gpus,
    };
    match plan(&input)? {
        Verdict::Fits(plan) => Ok(*plan),
        Verdict::Refused(r) => {
            print!("{}", r.details());
            Err(anyhow::anyhow!("does not fit: {r}"))
        }
    }
}

/// One line: where the job's bytes will live and, on a GPU, the predicted step time.
fn print_plan(plan: &Plan, device: Device) {
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let budget = &plan.budget;
    match device {
        Device::Cpu => println!(
            "plan: {:.2} GiB of {:.2} GiB host memory",
            gib(budget.device.used + budget.host_used()),
            gib(plan.memory.host_bytes)
        ),
        Device::Cuda(_) => println!(
            "plan: {} of {} units resident ({}), checkpoints {}; {:.2} GiB of {:.2} GiB GPU \
             memory, {:.2} GiB of {:.2} GiB host; {:.2} s per step predicted",
            plan.placement.resident_units.len(),
            plan.model.units,
            plan.placement.resident_summary,
            match plan.placement.checkpoints {
                CheckpointTier::Device => "on the device",
                CheckpointTier::Host => "in host memory",
            },
            gib(budget.device.used),
            gib(plan.memory.gpu_bytes),
            gib(budget.host_used()),
            gib(plan.memory.host_bytes),
            plan.time.total_s,
        ),
    }
}

/// Prints events: a summary at the start, one line per step above a progress bar.
struct Printer {
    bar: Option<ProgressBar>,
}

impl Printer {
    /// A line on stdout that does not tear the progress bar.
    fn line(&self, text: String) {
        match &self.bar {
            Some(bar) if !bar.is_hidden() => bar.println(text),
            _ => println!("{text}"),
        }
    }
}

impl Observer for Printer {
    fn event(&mut self, event: &Event) {
        match event {
            Event::Started {
                params,
                backend,
                total_steps,
                data,
                host_store,
                device_bytes,
                resumed_at,
            } => {
                if *resumed_at > 0 {
                    self.line(format!("resuming after step {resumed_at}"));
                }
                self.line(format!(
                    "memory: host store {:.1} MB (master {:.1}, Adam moments {:.1}, streaming copy {:.1}, gradients {:.1}), device {:.1} MB",
                    host_store.total() as f64 / 1e6,
                    host_store.master as f64 / 1e6,
                    host_store.moments as f64 / 1e6,
                    host_store.streaming as f64 / 1e6,
                    host_store.grads as f64 / 1e6,
                    *device_bytes as f64 / 1e6,
                ));
                self.line(format!(
                    "model: {:.2}M parameters on {backend}; data: {} records, {} samples, {} rows, {} tokens ({} trained), {} truncated samples ({} tokens dropped)",
                    *params as f64 / 1e6,
                    data.records,
                    data.samples,
                    data.rows,
                    data.tokens,
                    data.trained_tokens,
                    data.truncated_samples,
                    data.dropped_tokens,
                ));
                let bar = ProgressBar::new(*total_steps);
                bar.set_position(*resumed_at);
                bar.set_style(
                    ProgressStyle::with_template(
                        "{bar:40} {pos}/{len} steps  {elapsed} elapsed, eta {eta}",
                    )
                    .unwrap_or_else(|_| ProgressStyle::default_bar()),
                );
                self.bar = Some(bar);
            }
            Event::Step(m) => {
                let hidden = 1.0
                    - m.optimizer_exposed.as_secs_f64() / m.optimizer_time.as_secs_f64().max(1e-9);
                self.line(format!(
                    "step {:>5}  loss {:.4}  lr {:.3e}  grad_norm {:.3}  tokens/s {:.0}  ({:.2}s; h2d {:.1} MB, d2h {:.1} MB; optimizer {:.0} ms, {:.0}% hidden)",
                    m.step,
                    m.loss,
                    m.lr,
                    m.grad_norm,
                    m.tokens_per_second(),
                    m.elapsed.as_secs_f64(),
                    m.h2d_bytes as f64 / 1e6,
                    m.d2h_bytes as f64 / 1e6,
                    m.optimizer_time.as_secs_f64() * 1e3,
                    100.0 * hidden.clamp(0.0, 1.0),
                ));
                if let Some(eval) = m.eval_loss {
                    self.line(format!("step {:>5}  eval loss {eval:.4}", m.step));
                }
                if let Some(bar) = &self.bar {
                    bar.set_position(m.step);
                }
            }
            Event::Saved { path, step } => {
                self.line(format!("saved step {step} to {}", path.display()));
            }
            Event::Notice(text) => self.line(format!("note: {text}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::gpu_ordinals;

    #[test]
    fn device_names_one_or_several_gpus() {
        assert_eq!(gpu_ordinals("cpu").expect("cpu"), Vec::<usize>::new());
        assert_eq!(gpu_ordinals("cuda").expect("cuda"), [0]);
        assert_eq!(gpu_ordinals("cuda:3").expect("cuda:3"), [3]);
        assert_eq!(gpu_ordinals("cuda:0,1, 2").expect("three"), [0, 1, 2]);
        for bad in ["gpu", "cuda0", "cuda:", "cuda:0,x", "cuda:1,1"] {
            let e = gpu_ordinals(bad).expect_err(bad).to_string();
            assert!(e.contains(bad), "{bad}: {e}");
        }
    }
}
