//! `sluice train`: fine-tune a model folder (or train a random-init preset) on a dataset from
//! the terminal, with a progress bar and one line per step.

use std::path::PathBuf;

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use sluice_engine::backend::cpu::Cpu;
use sluice_engine::data::DatasetSource;
use sluice_engine::optim::Schedule;
use sluice_engine::train::{Event, ModelSource, Observer, RunOptions, TrainConfig};
use sluice_engine::weights::SaveDtype;

#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("source").required(true).args(["model", "preset"])))]
pub(crate) struct TrainArgs {
    /// Hugging Face model folder (config.json, safetensors weights, tokenizer.json).
    #[arg(long, value_name = "DIR")]
    model: Option<PathBuf>,

    /// Random-init model shape instead of a folder: tiny, qwen2.5-0.5b, qwen2.5-7b, llama3-8b, ...
    #[arg(long, value_name = "NAME")]
    preset: Option<String>,

    /// Dataset: JSON Lines or JSON (alpaca, sharegpt, messages, prompt/completion, text), or a
    /// LLaMA-Factory dataset_info.json together with --dataset.
    #[arg(long, value_name = "FILE")]
    data: PathBuf,

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
}

pub(crate) fn run(args: TrainArgs) -> anyhow::Result<()> {
    let (model, default_out, default_lr) = match (&args.model, &args.preset) {
        (Some(dir), _) => {
            let name = dir.file_name().map_or("model".into(), |n| n.to_string_lossy().into_owned());
            (ModelSource::Dir(dir.clone()), name, 2e-5)
        }
        (None, Some(name)) => (ModelSource::Preset(name.clone()), name.clone(), 1e-3),
        (None, None) => anyhow::bail!("give --model DIR or --preset NAME"),
    };
    let data = match &args.dataset {
        Some(name) => DatasetSource::Registry { registry: args.data.clone(), name: name.clone() },
        None => DatasetSource::File(args.data.clone()),
    };
    let options = RunOptions {
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
    };
    let backend = Cpu;
    let mut printer = Printer { bar: None };
    let summary =
        sluice_engine::train::run(&backend, &options, &mut printer).context("training failed")?;
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
            Event::Started { params, backend, total_steps, data } => {
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
                bar.set_style(
                    ProgressStyle::with_template(
                        "{bar:40} {pos}/{len} steps  {elapsed} elapsed, eta {eta}",
                    )
                    .unwrap_or_else(|_| ProgressStyle::default_bar()),
                );
                self.bar = Some(bar);
            }
            Event::Step(m) => {
                self.line(format!(
                    "step {:>5}  loss {:.4}  lr {:.3e}  grad_norm {:.3}  tokens/s {:.0}  ({:.2}s)",
                    m.step,
                    m.loss,
                    m.lr,
                    m.grad_norm,
                    m.tokens_per_second(),
                    m.elapsed.as_secs_f64()
                ));
                if let Some(bar) = &self.bar {
                    bar.set_position(m.step);
                }
            }
            Event::Saved { path, step } => {
                self.line(format!("saved step {step} to {}", path.display()));
            }
        }
    }
}
