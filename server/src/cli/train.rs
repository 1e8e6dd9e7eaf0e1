//! `sluice train`: fine-tune a model folder (or train a random-init preset) on a dataset from
//! the terminal, with a progress bar and one line per step.

use std::path::PathBuf;

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::Value;
use sluice_engine::data::{Columns, DatasetSource, ReadOptions};
use sluice_engine::plan::{CheckpointTier, Plan, Verdict, plan};
use sluice_engine::train::{
    Devices, Event, Job, JobSettings, ModelSource, Observer, RunOptions, model_spec, read_run_job,
    run_on,
};

use super::settings::{self, SettingsFlags};
use super::shape::ShapeArgs;

/// Every setting is optional here: what is not given is the engine's default
/// ([`JobSettings::default`]), the same as for a job submitted to the appliance.
#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("source").required(true).args(["model", "preset", "resume"])))]
pub(crate) struct TrainArgs {
    /// Continue the run in this folder exactly where its last saved state left it, with the
    /// options it was started with (no other option but --device, the memory limits and where
    /// the Adam moments live: --moments, --disk-dir, which change no result).
    #[arg(long, value_name = "OUT", conflicts_with_all = [
        "model", "preset", "data", "dataset", "out", "seq_len", "micro_batch", "grad_accum",
        "eval_data", "skip_invalid", "columns", settings::GROUP,
    ])]
    resume: Option<PathBuf>,

    #[command(flatten)]
    shape: ShapeArgs,

    /// Dataset: JSON Lines, JSON, CSV, TSV or Parquet (alpaca, sharegpt, messages,
    /// prompt/completion, text), or a LLaMA-Factory dataset_info.json together with --dataset.
    #[arg(long, value_name = "FILE", required_unless_present = "resume")]
    data: Option<PathBuf>,

    /// Dataset name inside a dataset_info.json registry.
    #[arg(long, value_name = "NAME")]
    dataset: Option<String>,

    /// Leave out invalid records of --data (each is listed) instead of refusing the dataset.
    #[arg(long)]
    skip_invalid: bool,

    /// Read these columns of --data as a format's fields, role=column separated by commas:
    /// instruction=question,output=answer (roles: instruction, input, output, system, history,
    /// prompt, completion, text, messages, conversations) [default: a table's usual names].
    #[arg(long, value_name = "ROLE=COLUMN,...", conflicts_with = "dataset")]
    columns: Option<String>,

    /// Run folder; checkpoints go to OUT/checkpoint-<step> and OUT/final [default: runs/<model>].
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,

    /// Every setting of the job but the batch shape and the moments policy (those are with
    /// the shape flags above), one flag per engine setting.
    #[command(flatten)]
    settings: SettingsFlags,

    /// Evaluate on this held-out dataset (same formats as --data) instead of part of the
    /// data: its loss before the first step, every --eval-every steps and after the last.
    #[arg(long, value_name = "FILE")]
    eval_data: Option<PathBuf>,
}

pub(crate) fn run(args: TrainArgs) -> anyhow::Result<()> {
    let shape = args.shape.clone();
    let (job, out, resume) = match &args.resume {
        Some(out) => {
            let mut job = read_run_job(out).context("cannot resume")?;
            if let Some(devices) = args.shape.device.clone() {
                job.devices = devices;
            }
            if let Some(moments) = args.shape.moments {
                job.settings.moments = moments;
            }
            (job, out.clone(), true)
        }
        None => {
            let (job, out) = job(args)?;
            (job, out, false)
        }
    };
    job.validate(&sluice_engine::train::Limits::ENGINE)?;
    if job.data.skips_invalid() {
        print_skipped(&job.data)?;
    }
    // The planner decides where everything lives, and refuses a job that cannot fit, before
    // anything is loaded or allocated.
    let plan = plan_run(&job, &shape)?;
    let options = RunOptions::planned(job, out, &plan)?;
    print_plan(&plan, &options);
    let mut printer = Printer { bar: None };
    let summary =
        run_on(&options.job.devices, &options, resume, &mut printer).context("training failed")?;
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

/// Lists the records a lenient run leaves out: the same the engine skips when it loads the data.
fn print_skipped(data: &DatasetSource) -> anyhow::Result<()> {
    const SHOWN: usize = 20;
    let lint = data.open().and_then(|reader| reader.lint(SHOWN))?;
    if lint.bad == 0 {
        return Ok(());
    }
    println!("skipping {} invalid records ({} kept):", lint.bad, lint.records);
    for line in lint.problem_lines() {
        println!("  {line}");
    }
    if lint.bad > SHOWN {
        println!("  ... and {} more", lint.bad - SHOWN);
    }
    Ok(())
}

/// The job the command line describes, and its run folder.
fn job(args: TrainArgs) -> anyhow::Result<(Job, PathBuf)> {
    let model = args.shape.source()?;
    let default_out = match &model {
        ModelSource::Dir(dir) => {
            dir.file_name().map_or("model".into(), |n| n.to_string_lossy().into_owned())
        }
        ModelSource::Preset(name) => name.clone(),
    };
    let Some(data) = args.data.clone() else { anyhow::bail!("give --data FILE") };
    let data = match &args.dataset {
        Some(name) => DatasetSource::Registry { registry: data, name: name.clone() },
        None => DatasetSource::File(data),
    };
    let columns = Columns::parse(args.columns.as_deref().unwrap_or_default())?;
    let data = data.with(ReadOptions { columns, skip_invalid: args.skip_invalid });
    // The settings as the API would receive them: the shape flags given, then the rest.
    let mut fields = args.settings.given;
    let shape = [
        ("seq_len", args.shape.seq_len.map(Value::from)),
        ("micro_batch", args.shape.micro_batch.map(Value::from)),
        ("grad_accum", args.shape.grad_accum.map(Value::from)),
        ("moments", args.shape.moments.map(|m| Value::from(m.to_string()))),
    ];
    for (name, value) in shape {
        if let Some(value) = value {
            fields.insert(name.to_string(), value);
        }
    }
    let settings = JobSettings::from_json(fields)?;
    let job = Job {
        model,
        data,
        eval_data: args.eval_data.map(DatasetSource::File),
        devices: args.shape.device.unwrap_or(Devices::Cpu),
        settings,
    };
    let out = args.out.unwrap_or_else(|| PathBuf::from("runs").join(default_out));
    Ok((job, out))
}

/// Plans the job on this machine (or the memory given, with the disk tier the flags name) with
/// what the streamer implements; a job that does not fit is an error carrying the planner's
/// reason and what would fit, after the same details `sluice plan` prints.
fn plan_run(job: &Job, shape: &ShapeArgs) -> anyhow::Result<Plan> {
    let spec = model_spec(&job.model)?;
    let memory = shape
        .memory(job.devices.gpu_query(), job.settings.moments)
        .with_context(|| format!("the machine of {}", job.devices))?;
    match plan(&job.plan_input(&spec, memory))? {
        Verdict::Fits(mut plan) => {
            plan.eval = job.eval_plan(&spec);
            Ok(*plan)
        }
        Verdict::Refused(r) => {
            print!("{}", r.details());
            Err(anyhow::anyhow!("does not fit: {r}"))
        }
    }
}

/// One line: where the job's bytes will live and, on a GPU, the predicted step time.
fn print_plan(plan: &Plan, options: &RunOptions) {
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let budget = &plan.budget;
    match options.job.devices {
        Devices::Cpu => println!(
            "plan: {:.2} GiB of {:.2} GiB host memory",
            gib(budget.device.used + budget.host_used()),
            gib(plan.memory.host_bytes)
        ),
        Devices::Cuda(_) => println!(
            "plan: {} ({}), checkpoints {}; {:.2} GiB of {:.2} GiB GPU memory, {:.2} GiB of \
             {:.2} GiB host; {:.2} s per step predicted",
            options.placement.describe(plan.model.units),
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
    if let Some(disk) = plan.disk_text() {
        println!("  {disk}");
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
                active_params: _,
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
                    "model: {:.2}M parameters on {backend}; data: {} records, {} samples, {} rows, {} tokens ({} trained), {} truncated samples ({} tokens dropped), {} texts continued over rows",
                    *params as f64 / 1e6,
                    data.records,
                    data.samples,
                    data.rows,
                    data.tokens,
                    data.trained_tokens,
                    data.truncated_samples,
                    data.dropped_tokens,
                    data.continued_samples,
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
                if let Some(aux) = m.aux_loss {
                    self.line(format!("step {:>5}  load-balancing loss {aux:.4}", m.step));
                }
                if let Some(bar) = &self.bar {
                    bar.set_position(m.step);
                }
            }
            Event::Saved { path, step } => {
                self.line(format!("saved step {step} to {}", path.display()));
            }
            Event::Evaluated { step: 0, loss } => {
                self.line(format!("note: held-out loss before training: {loss:.4}"));
            }
            Event::Evaluated { step, loss } => {
                self.line(format!("step {step:>5}  eval loss {loss:.4}"));
            }
            Event::TaskEvaluated { step: 0, report } => {
                let metric = report.metric;
                self.line(format!("note: {metric} of the base model: {:.4}", report.score));
            }
            Event::TaskEvaluated { step, report } => {
                self.line(format!("step {step:>5}  eval {} {:.4}", report.metric, report.score));
            }
            Event::Notice(text) => self.line(format!("note: {text}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;
    use sluice_engine::optim::Schedule;
    use sluice_engine::plan::MomentsPolicy;
    use sluice_engine::train::GradientPolicy;
    use sluice_engine::weights::SaveDtype;

    use super::*;
    use std::path::Path;

    use crate::job_line::command_line;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(subcommand)]
        command: Sub,
    }

    #[derive(Debug, clap::Subcommand)]
    enum Sub {
        Train(Box<TrainArgs>),
    }

    fn parse(line: &[&str]) -> Job {
        let Sub::Train(args) = Cli::try_parse_from(line).expect("parses").command;
        job(*args).expect("a job").0
    }

    #[test]
    fn the_shown_command_line_runs_the_same_job() {
        let job = Job {
            model: ModelSource::Dir("/data/models/my model's".into()),
            data: DatasetSource::File("/data/datasets/3.jsonl".into()),
            eval_data: Some(DatasetSource::File("/data/datasets/4.jsonl".into())),
            devices: Devices::Cuda(vec![0, 1]),
            settings: JobSettings {
                seq_len: 1024,
                micro_batch: 8,
                grad_accum: 8,
                steps: Some(50),
                lr: Some(3e-5),
                schedule: Schedule::Linear,
                warmup: 5,
                weight_decay: 0.1,
                max_grad_norm: 0.5,
                gradients: GradientPolicy::HostBf16,
                moments: MomentsPolicy::Disk,
                seed: 7,
                train_on_prompt: true,
                save_every: Some(10),
                save_dtype: SaveDtype::F32,
                eval_every: Some(5),
                held_out: 0.1,
                eval_metric: sluice_engine::eval::EvalMetric::Extract,
                eval_answer: sluice_engine::eval::AnswerFormat::Regex,
                eval_pattern: Some("answer: (\\d+) it's".into()),
                eval_max_new_tokens: 64,
                eval_records: 50,
            },
        };
        let line = command_line(&job);
        assert!(line.starts_with("sluice train --model '/data/models/my model'\\''s'"), "{line}");
        // Read back as a shell would: split on spaces outside quotes, undo the quoting.
        let words = shell_words(&line);
        let words: Vec<&str> = words.iter().map(String::as_str).collect();
        assert_eq!(parse(&words), job, "{line}");
        let preset = Job {
            model: ModelSource::Preset("tiny".into()),
            devices: Devices::Cpu,
            eval_data: None,
            settings: JobSettings::default(),
            ..job
        };
        let line = command_line(&preset);
        assert_eq!(
            line,
            "sluice train --preset tiny --data /data/datasets/3.jsonl --device cpu --seq-len 256 \
             --micro-batch 4 --grad-accum 1"
        );
        let words: Vec<String> = shell_words(&line);
        let words: Vec<&str> = words.iter().map(String::as_str).collect();
        assert_eq!(parse(&words), preset);
    }

    #[test]
    fn dataset_flags_are_read_into_the_source_and_shown_again() {
        let job = parse(&[
            "sluice",
            "train",
            "--preset",
            "tiny",
            "--data",
            "qa.csv",
            "--skip-invalid",
            "--columns",
            "output=answer,instruction=question",
        ]);
        let read = job.data.read_options();
        assert!(read.skip_invalid);
        assert_eq!(read.columns.to_flag(), "instruction=question,output=answer");
        assert_eq!(job.data.path(), Path::new("qa.csv"));
        let line = command_line(&job);
        assert!(line.contains("--columns instruction=question,output=answer"), "{line}");
        assert!(line.ends_with("--skip-invalid"), "{line}");
        let words = shell_words(&line);
        let words: Vec<&str> = words.iter().map(String::as_str).collect();
        assert_eq!(parse(&words), job);

        let Sub::Train(args) = Cli::try_parse_from([
            "sluice",
            "train",
            "--preset",
            "tiny",
            "--data",
            "x.csv",
            "--columns",
            "question=instruction",
        ])
        .expect("parses")
        .command;
        let err = job_of_args(*args);
        assert!(err.contains("unknown role \"question\""), "{err}");
    }

    fn job_of_args(args: TrainArgs) -> String {
        match job(args) {
            Ok(_) => "no error".into(),
            Err(err) => err.to_string(),
        }
    }

    /// POSIX words of `line` with single quotes and backslash escapes (what
    /// `job_line::shell_quote` writes).
    fn shell_words(line: &str) -> Vec<String> {
        let (mut words, mut word, mut quoted, mut any) = (Vec::new(), String::new(), false, false);
        let mut chars = line.chars();
        while let Some(c) = chars.next() {
            match c {
                '\'' => {
                    quoted = !quoted;
                    any = true;
                }
                '\\' if !quoted => word.extend(chars.next()),
                ' ' if !quoted => {
                    if any || !word.is_empty() {
                        words.push(std::mem::take(&mut word));
                    }
                    any = false;
                }
                c => word.push(c),
            }
        }
        if any || !word.is_empty() {
            words.push(word);
        }
        words
    }

    #[test]
    fn device_flag_names_one_or_several_gpus() {
        let base = ["sluice", "train", "--preset", "tiny", "--data", "d.jsonl"];
        let with = |device: &str| {
            let mut line = base.to_vec();
            line.extend(["--device", device]);
            Cli::try_parse_from(line)
        };
        let Sub::Train(args) = with("cuda:0,1").expect("two GPUs").command;
        assert_eq!(args.shape.device, Some(Devices::Cuda(vec![0, 1])));
        let err = with("cuda:1,1").expect_err("twice").to_string();
        assert!(err.contains("GPU 1 is named twice"), "{err}");
        assert_eq!(parse(&base).devices, Devices::Cpu);
    }
}
