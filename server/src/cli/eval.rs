//! `sluice eval`: scores a model folder (or a preset's random weights, for timing) on an eval
//! set by a metric, as a training run's task evaluation does, and says how fast batched
//! generation or scoring ran: with every weight on the device, or `--streamed` a layer at a
//! time from host memory, as a model larger than the device is evaluated.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use sluice_engine::backend::Backend;
use sluice_engine::backend::cpu::Cpu;
use sluice_engine::backend::cuda::Cuda;
use sluice_engine::data::{self, DatasetSource};
use sluice_engine::eval::{
    Batched, EvalItem, EvalMetric, EvalTime, EvalWork, Inference, Loaded, TaskReport, TaskSettings,
    TaskTiming, choice_items, evaluate, items_from_entries,
};
use sluice_engine::generate::batch::Model as BatchModel;
use sluice_engine::generate::{BatchLimits, Generator, Scored, Streamed};
use sluice_engine::model::Decoder;
use sluice_engine::plan::MachineRates;
use sluice_engine::train::{JobSettings, LoadedModel, ModelSource, load_model};

use super::device::Device;

#[derive(Debug, clap::Args)]
pub(crate) struct EvalArgs {
    /// Hugging Face model folder (config.json, safetensors weights, tokenizer.json).
    #[arg(long, value_name = "DIR", conflicts_with = "preset", required_unless_present = "preset")]
    model: Option<PathBuf>,

    /// A preset's shape with random weights and the bundled tokenizer: for timing only.
    #[arg(long, value_name = "NAME")]
    preset: Option<String>,

    /// The eval set: a dataset file of questions and answers, or for `--metric choice` a JSON
    /// Lines file of {"question", "choices", "answer"}.
    #[arg(long, value_name = "FILE")]
    data: PathBuf,

    /// exact_match, contains, extract, rouge_l, bleu, choice or perplexity.
    #[arg(long, default_value = "exact_match")]
    metric: String,

    /// For extract: gsm8k, last_number, boxed or regex.
    #[arg(long, default_value = "last_number")]
    answer: String,

    /// For --answer regex: the pattern.
    #[arg(long, value_name = "REGEX")]
    pattern: Option<String>,

    /// Tokens an answer may take.
    #[arg(long, default_value_t = 128)]
    max_new_tokens: usize,

    /// Records scored (the first N).
    #[arg(long, default_value_t = 200)]
    records: usize,

    /// Sequences generated or scored at once.
    #[arg(long, default_value_t = 32)]
    batch: usize,

    /// New tokens one forward takes at most (longer prefills run in several).
    #[arg(long, default_value_t = 4096)]
    batch_tokens: usize,

    /// Keep the weights in host memory and stream each layer through the device once per
    /// forward (the embedding and head stay on it), as for a model larger than the device.
    #[arg(long)]
    streamed: bool,

    /// Also write the report (figures and every record's answer) as JSON.
    #[arg(long, value_name = "FILE")]
    report: Option<PathBuf>,

    /// Device: cpu, or cuda / cuda:N.
    #[arg(long, default_value = "cpu")]
    device: Device,
}

pub(crate) fn run(args: EvalArgs) -> anyhow::Result<()> {
    // The job settings' checks, so the bounds and messages are a training job's.
    let mut settings = serde_json::Map::new();
    settings.insert("eval_metric".into(), args.metric.clone().into());
    settings.insert("eval_answer".into(), args.answer.clone().into());
    if let Some(pattern) = &args.pattern {
        settings.insert("eval_pattern".into(), pattern.clone().into());
    }
    settings.insert("eval_max_new_tokens".into(), args.max_new_tokens.into());
    settings.insert("eval_records".into(), args.records.into());
    let settings = JobSettings::from_json(settings)?;
    settings.validate(&sluice_engine::train::Limits::ENGINE)?;
    let task = settings.task().context("--metric loss: nothing to evaluate but the loss")?;
    let limits = BatchLimits { sequences: args.batch, tokens: args.batch_tokens };
    limits.check()?;
    let source = match (&args.model, &args.preset) {
        (Some(dir), _) => ModelSource::Dir(dir.clone()),
        (None, Some(name)) => ModelSource::Preset(name.clone()),
        (None, None) => anyhow::bail!("give --model DIR or --preset NAME"),
    };
    let items = items(&args, &task)?;
    let model = load_model(&source, 0).context("loading the model")?;
    match args.device {
        Device::Cpu => eval_on(Cpu, model, &args, &task, &items, limits, MachineRates::cpu()),
        Device::Cuda(ordinal) => {
            let gpu = Cuda::new(ordinal)
                .with_context(|| format!("--device cuda:{ordinal}: cannot use the GPU"))?;
            eval_on(gpu, model, &args, &task, &items, limits, MachineRates::default())
        }
    }
}

fn items(args: &EvalArgs, task: &TaskSettings) -> anyhow::Result<Vec<EvalItem>> {
    let items = if task.metric == EvalMetric::Choice {
        choice_items(&args.data)?
    } else {
        let (_, entries) = data::read_entries(&DatasetSource::File(args.data.clone()))?;
        items_from_entries(&entries, task.metric)?
    };
    Ok(items)
}

/// Counts what the model was asked, for the throughput line.
struct Counted<'a> {
    inner: &'a mut dyn Inference,
    generated: usize,
    scored: usize,
}

impl Inference for Counted<'_> {
    fn tokenizer(&self) -> &sluice_engine::data::Tokenizer {
        self.inner.tokenizer()
    }
    fn generate(
        &mut self,
        prompts: &[Vec<u32>],
        max_new_tokens: usize,
    ) -> sluice_engine::Result<Vec<Vec<u32>>> {
        let out = self.inner.generate(prompts, max_new_tokens)?;
        self.generated += out.iter().map(Vec::len).sum::<usize>();
        Ok(out)
    }
    fn score(&mut self, pairs: &[(Vec<u32>, Vec<u32>)]) -> sluice_engine::Result<Vec<Scored>> {
        self.scored += pairs.iter().map(|(c, t)| c.len() + t.len()).sum::<usize>();
        self.inner.score(pairs)
    }
    fn max_positions(&self) -> usize {
        self.inner.max_positions()
    }
    fn predict(&self, work: &EvalWork) -> Option<EvalTime> {
        self.inner.predict(work)
    }
}

fn eval_on<B: Backend>(
    backend: B,
    model: LoadedModel,
    args: &EvalArgs,
    task: &TaskSettings,
    items: &[EvalItem],
    limits: BatchLimits,
    rates: MachineRates,
) -> anyhow::Result<()> {
    let name = backend.name();
    let LoadedModel { spec, params, tokenizer, .. } = model;
    let loading = Instant::now();
    let (report, counted, seconds, load_s) = if args.streamed {
        let layout = params.layout.clone();
        let decoder = Decoder::new(&backend, &spec, layout.layers.clone(), layout.head.clone())?;
        let mut units = Streamed::new(&backend, &layout, &params)?;
        let model = BatchModel { b: &backend, spec: &spec, decoder: &decoder };
        let mut batched =
            Batched { model: &model, units: &mut units, tokenizer: &tokenizer, limits, rates };
        let load_s = loading.elapsed().as_secs_f64();
        let start = Instant::now();
        let (report, counted) = run_counted(&mut batched, task, items)?;
        (report, counted, start.elapsed().as_secs_f64(), load_s)
    } else {
        let generator = Generator::on(backend, spec, params, Some(tokenizer))?;
        let mut loaded = Loaded::new(&generator, limits, rates)?;
        let load_s = loading.elapsed().as_secs_f64();
        let start = Instant::now();
        let (report, counted) = run_counted(&mut loaded, task, items)?;
        (report, counted, start.elapsed().as_secs_f64(), load_s)
    };
    let seconds = seconds.max(1e-9);
    let extra: String = report.extra.iter().map(|(k, v)| format!(", {k} {v:.4}")).collect();
    println!("{} {:.4}{extra} over {} records", report.metric, report.score, report.answers.len());
    let (what, count) = match counted {
        (generated, 0) => ("tokens generated", generated),
        (_, scored) => ("tokens scored", scored),
    };
    let placement = if args.streamed { "streamed from host memory" } else { "resident" };
    eprintln!(
        "{count} {what} in {seconds:.2} s ({:.1} tokens/s), batch {} on {name}, weights \
         {placement} (loaded in {load_s:.1} s)",
        count as f64 / seconds,
        limits.sequences,
    );
    if let Some(TaskTiming { seconds, predicted: Some(p) }) = report.timing {
        eprintln!(
            "predicted {:.2} s ({} forwards, {} logit rows: uploads {:.2} s, compute {:.2} s, \
             per-sequence work and logits {:.2} s), measured {seconds:.2} s: {:.2}x",
            p.seconds,
            p.forwards,
            p.rows,
            p.upload_s,
            p.compute_s,
            p.overhead_s,
            seconds / p.seconds.max(1e-12),
        );
    }
    if let Some(path) = &args.report {
        let json = serde_json::to_vec_pretty(&report)?;
        std::fs::write(path, json).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

fn run_counted(
    inference: &mut dyn Inference,
    task: &TaskSettings,
    items: &[EvalItem],
) -> anyhow::Result<(TaskReport, (usize, usize))> {
    let mut counted = Counted { inner: inference, generated: 0, scored: 0 };
    let report = evaluate(&mut counted, task, items)?;
    Ok((report, (counted.generated, counted.scored)))
}
