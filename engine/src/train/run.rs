//! A whole training run, from a model and a dataset on disk to checkpoint folders: what
//! `sluice train` and the appliance's job runner both call.

use std::path::{Path, PathBuf};

use std::io::Write;

use serde_json::{Value, json};

use super::job::{Job, Limits};
use super::state::{
    Position, RUN_FILE, STATE_DIR, TrainingState, data_fingerprint, save_checkpoint_from,
};
use super::{Event, Observer, TrainConfig};
use crate::backend::{AllReduce, Backend};
use crate::data::{self, DataOptions, MicroBatch, Stats, Tokenizer};
use crate::error::{Error, Result};
use crate::eval::{
    Batched, EvalItem, EvalMetric, TaskReport, TaskSettings, choice_items, evaluate,
    items_from_entries, limits_between_steps, prompt_ids,
};
use crate::generate::BatchLimits;
use crate::model::HostParams;
use crate::plan::{MachineRates, Plan};
use crate::schedule::from_plan::schedule_options;
use crate::schedule::{DataParallel, FillMoments, Interrupt, ScheduleOptions, Streamer};
use crate::spec::{self, ModelSpec};
use crate::store::{HostStore, StoreBytes};
use crate::weights::{
    DEFAULT_MAX_SHARD_BYTES, HfFolder, Passthrough, SaveDtype, TensorSource, save_hf_folder,
    write_file_atomically,
};
use std::sync::Arc;

/// Files of a model folder that travel with its weights into every checkpoint: the tokenizer's,
/// and a multimodal model's processor files (the image preprocessor's settings, the processor's
/// and its chat template).
const TOKENIZER_FILES: [&str; 8] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
    "chat_template.json",
    "preprocessor_config.json",
    "processor_config.json",
];

/// Where the model comes from.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ModelSource {
    /// A Hugging Face folder: `config.json`, safetensors weights, `tokenizer.json`.
    Dir(PathBuf),
    /// A random-init shape by name (see [`spec::PRESETS`]) with the bundled tokenizer.
    Preset(String),
}

/// What a run executes: the job, its run folder and the planner's placement as the streamer
/// runs it; saved as `OUT/run.json`. A resume reads the job back from it and plans again for
/// the machine it resumes on (placement changes no result).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RunOptions {
    pub job: Job,
    /// Run folder: checkpoints go to `OUT/checkpoint-<step>` and `OUT/final`, the resumable
    /// state to `OUT/state`.
    pub out: PathBuf,
    /// Where the streamer keeps things: [`schedule_options`] of the job's plan, the one mapping
    /// from a plan to the streamer.
    pub placement: ScheduleOptions,
    /// Keep only the latest N `checkpoint-<step>` folders and the best by held-out loss
    /// (`retention`); `None` keeps every one.
    #[serde(default)]
    pub keep_checkpoints: Option<usize>,
}

/// What a finished run reports.
#[derive(Debug, Clone)]
pub struct RunSummary {
    pub steps: u64,
    pub first_loss: f64,
    pub last_loss: f64,
    pub data: Stats,
    pub final_checkpoint: PathBuf,
}

/// A model ready to train: spec, weights, tokenizer, and the files an export copies.
pub struct LoadedModel {
    pub spec: ModelSpec,
    pub params: HostParams,
    pub tokenizer: Tokenizer,
    pub extra_files: Vec<(String, Vec<u8>)>,
    /// A multimodal model's untrained tensors (vision tower, projector) and how its checkpoints
    /// are written back as the wrapper; `None` for a text model.
    pub passthrough: Option<Passthrough>,
}

/// The model's shape alone (`config.json` or the preset), for planning before anything is
/// loaded.
pub fn model_spec(source: &ModelSource) -> Result<ModelSpec> {
    match source {
        ModelSource::Dir(dir) => {
            if !dir.is_dir() {
                return Err(Error::config(
                    dir,
                    "not a model folder (expected config.json, weights and tokenizer.json)",
                ));
            }
            ModelSpec::from_path(dir)
        }
        ModelSource::Preset(name) => spec::preset(name),
    }
}

/// Loads a model folder or builds a preset.
pub fn load_model(source: &ModelSource, seed: u64) -> Result<LoadedModel> {
    match source {
        ModelSource::Dir(dir) => {
            let spec = model_spec(source)?;
            let tokenizer = Tokenizer::from_dir(dir)?;
            let weights = TensorSource::open(dir)?;
            let params = HostParams::load(&spec, &weights)?;
            // The source stays mapped for the run: each checkpoint copies the untrained tensors
            // out of it.
            let passthrough = spec
                .wrapper_config()
                .map(|config| Passthrough::new(config, weights))
                .transpose()?;
            let mut extra_files = Vec::new();
            for name in TOKENIZER_FILES {
                let path = dir.join(name);
                if path.is_file() {
                    extra_files.push((
                        name.to_string(),
                        std::fs::read(&path).map_err(|e| Error::io(&path, e))?,
                    ));
                }
            }
            Ok(LoadedModel { spec, params, tokenizer, extra_files, passthrough })
        }
        ModelSource::Preset(name) => {
            let mut spec = spec::preset(name)?;
            let tokenizer = data::tiny_tokenizer()?;
            // The preset's config names the bundled tokenizer's special tokens, so an exported
            // checkpoint generates and stops as it was trained to.
            let eos = tokenizer.eos_token_id();
            spec.eos_token_ids = eos.into_iter().collect();
            if let Value::Object(map) = &mut spec.raw {
                map.insert("eos_token_id".into(), json!(eos));
                map.insert("pad_token_id".into(), json!(tokenizer.pad_token_id()));
            }
            let params = HostParams::random(&spec, seed);
            let extra_files = data::tiny_tokenizer_files()
                .iter()
                .map(|(name, bytes)| (name.to_string(), bytes.to_vec()))
                .collect();
            Ok(LoadedModel { spec, params, tokenizer, extra_files, passthrough: None })
        }
    }
}

impl RunOptions {
    /// The run of `job` in `out` with the placement of `plan` (the planner's answer for this
    /// job on this machine): what `sluice train` and the appliance's runner execute. The run
    /// checks the placement against the job ([`ScheduleOptions::check_runs`]) before it builds.
    pub fn planned(job: Job, out: PathBuf, plan: &Plan) -> Result<RunOptions> {
        let placement = schedule_options(plan, 0)?;
        Ok(RunOptions { job, out, placement, keep_checkpoints: None })
    }

    /// The run of `job` in `out` with the simplest placement, which needs no plan: every
    /// layer's input checkpointed on the device, nothing resident, gradients in host memory.
    /// For tests on the CPU backend, where placement changes no result.
    pub fn unplanned(job: Job, out: PathBuf) -> Result<RunOptions> {
        let placement = ScheduleOptions::simplest(job.settings.batch(), job.settings.clipping())?;
        Ok(RunOptions { job, out, placement, keep_checkpoints: None })
    }
}

/// Writes the current weights as a Hugging Face folder (a multimodal model's as its wrapper's).
pub fn save_checkpoint(
    dir: &Path,
    model: &LoadedModel,
    params: &HostParams,
    dtype: SaveDtype,
) -> Result<()> {
    let folder = HfFolder {
        tensors: params.tensor_refs(),
        dtype,
        max_shard_bytes: DEFAULT_MAX_SHARD_BYTES,
        config: model.spec.to_hf_config(),
        extra_files: model.extra_files.clone(),
    };
    match &model.passthrough {
        Some(p) => p.save(dir, folder),
        None => save_hf_folder(dir, &folder),
    }
}

/// Reads the job a run folder was started with, validated again: what a resume continues.
/// Only the job is read, so a `run.json` whose placement was recorded in an older shape still
/// resumes (the placement is planned again for the machine that resumes it).
pub fn read_run_job(out: &Path) -> Result<Job> {
    #[derive(serde::Deserialize)]
    struct RunFile {
        job: Job,
    }
    let path = out.join(RUN_FILE);
    let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
    let run: RunFile = serde_json::from_str(&text)
        .map_err(|e| Error::invalid(format!("{}: not a run description: {e}", path.display())))?;
    run.job
        .validate(&Limits::ENGINE)
        .map_err(|e| Error::invalid(format!("{}: {e}", path.display())))?;
    Ok(run.job)
}

/// Trains `options.job.model` on `options.job.data` and writes checkpoints; reports progress to
/// `observer`. Everything is checked (options, model, every dataset record) before the first
/// step, so a bad input fails fast and writes nothing. With `resume`, continues from the
/// training state saved in `options.out` (exactly: same data order, same updates).
pub fn run<B: Backend>(
    b: &B,
    options: &RunOptions,
    resume: bool,
    observer: &mut dyn Observer,
) -> Result<RunSummary> {
    let build = |spec: &ModelSpec, params, config, schedule| {
        Streamer::new(b, spec, params, config, schedule)
    };
    run_with(b.name(), build, options, resume, observer)
}

/// [`run`] on several devices of one host (data parallelism): `peers[r]` links rank r, on
/// `backends[r]`, to the others. Each step's micro-batches are shared among the devices, so
/// `grad_accum` must be at least their number.
pub fn run_parallel<'b, B: Backend>(
    backends: &[&'b B],
    peers: Vec<Box<dyn AllReduce<B> + 'b>>,
    options: &RunOptions,
    resume: bool,
    observer: &mut dyn Observer,
) -> Result<RunSummary>
where
    Streamer<'b, B>: Send,
{
    let names: Vec<String> = backends.iter().map(|b| b.name()).collect();
    let build = |spec: &ModelSpec, params, config, schedule| {
        DataParallel::new(backends, peers, spec, params, config, schedule)
    };
    run_with(names.join(" + "), build, options, resume, observer)
}

/// What a run drives: one streamer, or several sharing each step.
trait Stepper {
    fn step(&mut self, micro: &[MicroBatch]) -> Result<super::StepMetrics>;
    fn eval_loss(&mut self, micro: &[MicroBatch]) -> Result<f64>;
    /// Waits for every update and returns the host store to save from.
    fn settled_store(&mut self) -> Result<Arc<HostStore>>;
    fn restore(&mut self, step: u64, moments: &mut FillMoments<'_>) -> Result<()>;
    fn finish(&mut self) -> Result<HostParams>;
    /// Optimizer steps taken.
    fn taken(&self) -> u64;
    fn store_bytes(&self) -> StoreBytes;
    /// Device bytes per device.
    fn device_bytes(&self) -> usize;
    /// See [`Streamer::set_interrupt`]; several devices are never interrupted mid-step.
    fn set_interrupt(&mut self, _check: Interrupt) {}
    /// A task evaluation of the weights as they stand (see [`Streamer::with_host_model`]).
    fn task_eval(
        &mut self,
        tokenizer: &Tokenizer,
        task: &TaskSettings,
        items: &[EvalItem],
        limits: BatchLimits,
        rates: &MachineRates,
    ) -> Result<TaskReport>;
}

fn task_eval_on<B: Backend>(
    streamer: &mut Streamer<'_, B>,
    tokenizer: &Tokenizer,
    task: &TaskSettings,
    items: &[EvalItem],
    limits: BatchLimits,
    rates: &MachineRates,
) -> Result<TaskReport> {
    streamer.with_host_model(|model, units| {
        let mut inference = Batched { model, units, tokenizer, limits, rates: *rates };
        evaluate(&mut inference, task, items)
    })
}

impl<B: Backend> Stepper for Streamer<'_, B> {
    fn step(&mut self, micro: &[MicroBatch]) -> Result<super::StepMetrics> {
        Streamer::step(self, micro).map(|(m, _)| m)
    }
    fn eval_loss(&mut self, micro: &[MicroBatch]) -> Result<f64> {
        Streamer::eval_loss(self, micro)
    }
    fn settled_store(&mut self) -> Result<Arc<HostStore>> {
        Streamer::settled_store(self)
    }
    fn restore(&mut self, step: u64, moments: &mut FillMoments<'_>) -> Result<()> {
        Streamer::restore(self, step, moments)
    }
    fn finish(&mut self) -> Result<HostParams> {
        Streamer::finish(self)
    }
    fn taken(&self) -> u64 {
        self.step
    }
    fn store_bytes(&self) -> StoreBytes {
        self.store().bytes()
    }
    fn device_bytes(&self) -> usize {
        self.device_bytes
    }
    fn set_interrupt(&mut self, check: Interrupt) {
        Streamer::set_interrupt(self, check);
    }
    fn task_eval(
        &mut self,
        tokenizer: &Tokenizer,
        task: &TaskSettings,
        items: &[EvalItem],
        limits: BatchLimits,
        rates: &MachineRates,
    ) -> Result<TaskReport> {
        task_eval_on(self, tokenizer, task, items, limits, rates)
    }
}

impl<'b, B: Backend> Stepper for DataParallel<'b, B>
where
    Streamer<'b, B>: Send,
{
    fn step(&mut self, micro: &[MicroBatch]) -> Result<super::StepMetrics> {
        DataParallel::step(self, micro).map(|(m, _)| m)
    }
    fn eval_loss(&mut self, micro: &[MicroBatch]) -> Result<f64> {
        DataParallel::eval_loss(self, micro)
    }
    fn settled_store(&mut self) -> Result<Arc<HostStore>> {
        DataParallel::settled_store(self)
    }
    fn restore(&mut self, step: u64, moments: &mut FillMoments<'_>) -> Result<()> {
        DataParallel::restore(self, step, moments)
    }
    fn finish(&mut self) -> Result<HostParams> {
        DataParallel::finish(self)
    }
    fn taken(&self) -> u64 {
        self.lead().step
    }
    fn store_bytes(&self) -> StoreBytes {
        self.lead().store().bytes()
    }
    fn device_bytes(&self) -> usize {
        self.lead().device_bytes
    }
    fn task_eval(
        &mut self,
        tokenizer: &Tokenizer,
        task: &TaskSettings,
        items: &[EvalItem],
        limits: BatchLimits,
        rates: &MachineRates,
    ) -> Result<TaskReport> {
        task_eval_on(self.lead_mut(), tokenizer, task, items, limits, rates)
    }
}

/// A run's task evaluation, if it has one.
struct TaskRun<'a> {
    task: Option<&'a TaskSettings>,
    items: &'a [EvalItem],
    tokenizer: &'a Tokenizer,
    limits: BatchLimits,
    rates: MachineRates,
}

impl TaskRun<'_> {
    /// Evaluates the weights after `step` steps, records the report in the run folder and
    /// tells the observer; the figure, or `None` without a task.
    fn run<S: Stepper>(
        &self,
        streamer: &mut S,
        step: u64,
        out: &Path,
        observer: &mut dyn Observer,
    ) -> Result<Option<f64>> {
        let Some(task) = self.task else { return Ok(None) };
        let report =
            streamer.task_eval(self.tokenizer, task, self.items, self.limits, &self.rates)?;
        super::task_reports::save(out, step, &report)?;
        let score = report.score;
        observer.event(&Event::TaskEvaluated { step, report });
        Ok(Some(score))
    }
}

/// How many of a dataset's `records` a task evaluation without an evaluation dataset holds out
/// of training: the last `fraction` of them, at least one and never all; `None` below two
/// records.
pub fn held_out_records(records: usize, fraction: f64) -> Option<usize> {
    (records >= 2).then(|| ((records as f64 * fraction).floor() as usize).clamp(1, records - 1))
}

/// The task's eval items: a separate evaluation dataset's, or records held out of the training
/// data (the last `held_out` fraction, at least one, never all), which are then also returned
/// so their loss is the eval loss.
fn task_items(
    job: &Job,
    task: &TaskSettings,
    entries: &mut Vec<data::Entry>,
) -> Result<(Vec<EvalItem>, Option<Vec<data::Entry>>)> {
    match &job.eval_data {
        Some(data::DatasetSource::Registry { .. }) if task.metric == EvalMetric::Choice => {
            Err(Error::invalid(
                "eval_metric choice reads a JSON Lines file of questions with choices, not a \
                 dataset registry",
            ))
        }
        Some(source) if task.metric == EvalMetric::Choice => {
            Ok((choice_items(source.path())?, None))
        }
        Some(source) => {
            let (_, records) = data::read_entries(source)?;
            Ok((items_from_entries(&records, task.metric)?, None))
        }
        None => {
            // Refuses `choice` (the training records have no choices) before anything is split.
            items_from_entries(&[], task.metric)?;
            let n = entries.len();
            let Some(held) = held_out_records(n, job.settings.held_out) else {
                return Err(Error::invalid(format!(
                    "eval_metric {}: the dataset has {n} record; hold some out needs at least 2, \
                     or give an evaluation dataset",
                    task.metric
                )));
            };
            let held = entries.split_off(n - held);
            Ok((items_from_entries(&held, task.metric)?, Some(held)))
        }
    }
}

fn run_with<S: Stepper>(
    backend: String,
    build: impl FnOnce(&ModelSpec, HostParams, TrainConfig, ScheduleOptions) -> Result<S>,
    options: &RunOptions,
    resume: bool,
    observer: &mut dyn Observer,
) -> Result<RunSummary> {
    let job = &options.job;
    let settings = &job.settings;
    job.validate(&Limits::ENGINE)?;
    let mut model = load_model(&job.model, settings.seed)?;
    if model.tokenizer.vocab_size() > model.spec.vocab {
        return Err(Error::invalid(format!(
            "the tokenizer has {} tokens but the model's vocabulary is {}",
            model.tokenizer.vocab_size(),
            model.spec.vocab
        )));
    }
    let data_options = DataOptions {
        seq_len: settings.seq_len,
        train_on_prompt: settings.train_on_prompt,
        shuffle_seed: Some(settings.seed),
    };
    let (data_path, mut entries) = data::read_entries(&job.data)?;
    let task = settings.task();
    let (eval_items, held_records) = match &task {
        Some(task) => task_items(job, task, &mut entries)?,
        None => (Vec::new(), None),
    };
    let packed = data::pack_entries(&data_path, &entries, &model.tokenizer, &data_options)?;
    let batches: Vec<MicroBatch> = packed.micro_batches(settings.micro_batch)?;
    if batches.is_empty() {
        return Err(Error::invalid("the dataset produced no training rows"));
    }
    let fingerprint = data_fingerprint(&batches);
    let mut batches = batches;
    let mut notices = Vec::new();
    // A multiple-choice eval file is not in a training format: its loss cannot be taken.
    let eval_file = job.eval_data.as_ref().filter(|_| settings.eval_metric != EvalMetric::Choice);
    let eval: Vec<MicroBatch> = match (eval_file, settings.eval_every) {
        _ if held_records.is_some() => {
            // The records held out for the task: their loss too, so both figures describe
            // the same unseen records.
            let held = held_records.as_deref().unwrap_or_default();
            let eval_options = DataOptions { shuffle_seed: None, ..data_options };
            let held = data::pack_entries(&data_path, held, &model.tokenizer, &eval_options)?;
            let eval = held.micro_batches(settings.micro_batch)?;
            if eval.iter().all(|mb| mb.trained_tokens() == 0) { Vec::new() } else { eval }
        }
        (Some(source), _) => {
            let eval_options = DataOptions { shuffle_seed: None, ..data_options };
            let held_out = data::load(source, &model.tokenizer, &eval_options)?;
            let eval = held_out.micro_batches(settings.micro_batch)?;
            if eval.iter().all(|mb| mb.trained_tokens() == 0) {
                return Err(Error::invalid(
                    "the evaluation dataset has no token that carries loss",
                ));
            }
            eval
        }
        (None, Some(_)) if batches.len() >= 2 => {
            // At least one micro-batch, and always one left to train on.
            let fraction = (batches.len() as f64 * settings.held_out).floor() as usize;
            let held_out = fraction.clamp(1, batches.len() - 1);
            batches.split_off(batches.len() - held_out)
        }
        (None, Some(_)) => {
            notices.push("too little data to hold out an evaluation set: no eval loss".to_string());
            Vec::new()
        }
        (None, None) => Vec::new(),
    };
    let per_step = settings.grad_accum;
    let steps = settings.steps.unwrap_or_else(|| batches.len().div_ceil(per_step) as u64);
    let save_every = super::retention::save_interval(settings.save_every, steps);

    let mut state = if resume {
        let state = TrainingState::load(&options.out.join(STATE_DIR), &model.spec)?;
        if state.position.data_fingerprint != fingerprint {
            return Err(Error::invalid(
                "the dataset (or how it is packed) changed since the run started; cannot resume exactly",
            ));
        }
        Some(state)
    } else {
        None
    };

    let mut config = job.train_config();
    config.total_steps = steps;
    let schedule = options.placement.clone();
    schedule.check_runs(settings.batch(), config.max_grad_norm.is_some())?;
    // The streamer takes the weights it starts from; no copy stays behind (at 7B a copy of
    // the f32 master is 30 GB the host store needs).
    let initial = std::mem::take(&mut model.params.units);
    let params = match &mut state {
        Some(s) => std::mem::take(&mut s.master.units),
        None => initial,
    };
    let params = HostParams { layout: model.params.layout.clone(), units: params };
    let mut streamer = build(&model.spec, params, config, schedule)?;
    if let Some(check) = observer.interrupt() {
        streamer.set_interrupt(check);
    }
    let mut cursor = 0usize;
    if let Some(s) = state.take() {
        let layout = model.params.layout.clone();
        streamer.restore(s.position.step, &mut |u, m, v| s.fill_moments(&layout, u, m, v))?;
        cursor = s.position.cursor;
    } else {
        std::fs::create_dir_all(&options.out).map_err(|e| Error::io(&options.out, e))?;
        let json = serde_json::to_vec_pretty(options)
            .map_err(|e| Error::invalid(format!("cannot describe the run: {e}")))?;
        write_file_atomically(&options.out.join(RUN_FILE), |w| w.write_all(&json))?;
    }
    observer.event(&Event::Started {
        params: model.spec.total_params(),
        active_params: model.spec.active_params(),
        backend,
        total_steps: steps,
        data: packed.stats,
        host_store: streamer.store_bytes(),
        device_bytes: streamer.device_bytes(),
        resumed_at: streamer.taken(),
    });
    for notice in notices {
        observer.event(&Event::Notice(notice));
    }

    if !eval.is_empty() && streamer.taken() == 0 {
        let loss = streamer.eval_loss(&eval)?;
        observer.event(&Event::Evaluated { step: 0, loss });
    }
    // The longest prompt decides how many sequences fit the memory the planner left for them.
    let longest = eval_items
        .iter()
        .take(settings.eval_records)
        .map(|item| {
            // A prompt that cannot be rendered counts nothing here; the evaluation says why.
            let prompt = prompt_ids(&model.tokenizer, &item.prompt).map_or(0, |ids| ids.len());
            let choice = item.choices.iter().map(|c| c.len() + 1).max().unwrap_or(0);
            prompt + choice.max(settings.eval_max_new_tokens)
        })
        .max()
        .unwrap_or(0);
    let limits = limits_between_steps(settings.eval_positions(), longest);
    let tasks = TaskRun {
        task: task.as_ref(),
        items: &eval_items,
        tokenizer: &model.tokenizer,
        limits,
        rates: job.rates(),
    };
    let task_before = match task {
        Some(_) if streamer.taken() == 0 => tasks.run(&mut streamer, 0, &options.out, observer)?,
        // Resumed: the base model's figure is the one the run recorded before its first step.
        Some(_) => super::task_reports::load(&options.out, 0).ok().map(|r| r.score),
        None => None,
    };

    let (mut first_loss, mut last_loss) = (f64::NAN, f64::NAN);
    let curves = std::cell::Cell::new(super::card::Curves::from_step(streamer.taken()));
    // Both folders are read straight out of the host store (and the disk tier): a save holds
    // no copy of the training state.
    let save = |streamer: &mut S, cursor: usize, dir: &Path| -> Result<()> {
        let store = streamer.settled_store()?;
        let layout = &model.params.layout;
        let config = model.spec.to_hf_config();
        let extra = model.extra_files.clone();
        let passthrough = model.passthrough.as_ref();
        save_checkpoint_from(dir, &store, layout, config, extra, settings.save_dtype, passthrough)?;
        super::card::write_model_card(dir, options, &curves.get())?;
        let position =
            Position { step: streamer.taken(), cursor, data_fingerprint: fingerprint.clone() };
        TrainingState::save(&options.out.join(STATE_DIR), &model.spec, &store, layout, &position)
    };
    while streamer.taken() < steps {
        if !observer.keep_going() {
            break;
        }
        // Steps walk through the micro-batches in order and wrap around at the end of the data.
        let step_batches: Vec<MicroBatch> =
            (0..per_step).map(|i| batches[(cursor + i) % batches.len()].clone()).collect();
        let mut metrics = match streamer.step(&step_batches) {
            Ok(metrics) => metrics,
            // Abandoned between micro-batches: the state is the last finished step's, and so
            // is the data position saved with it.
            Err(Error::Interrupted) => break,
            Err(e) => return Err(e),
        };
        cursor = (cursor + per_step) % batches.len();
        let due =
            metrics.step == steps || settings.eval_every.is_some_and(|n| metrics.step % n == 0);
        if !eval.is_empty() && due {
            metrics.eval_loss = Some(streamer.eval_loss(&eval)?);
        }
        let task_score = if due {
            tasks.run(&mut streamer, metrics.step, &options.out, observer)?
        } else {
            None
        };
        if first_loss.is_nan() {
            first_loss = metrics.loss;
        }
        last_loss = metrics.loss;
        curves.set(curves.get().after(&metrics));
        if let (Some(task), Some(score)) = (&task, task_score) {
            curves.set(curves.get().with_task(task.metric, task_before, score));
        }
        let (step, eval_loss) = (metrics.step, metrics.eval_loss);
        observer.event(&Event::Step(metrics));
        if save_every.is_some_and(|n| step % n == 0 && step < steps) {
            let dir = options.out.join(format!("checkpoint-{step}"));
            save(&mut streamer, cursor, &dir)?;
            // After the save, so the newest checkpoint (the resumable state's) always exists;
            // before the event, so whoever hears of the save finds the older ones gone.
            let pruned = super::retention::record_and_prune(
                &options.out,
                step,
                eval_loss,
                options.keep_checkpoints,
            )?;
            observer.event(&Event::Saved { path: dir, step });
            for dir in pruned {
                observer.event(&Event::Notice(format!(
                    "removed {} (keeping the latest and the best by eval loss)",
                    dir.file_name().map_or_else(String::new, |n| n.to_string_lossy().into_owned())
                )));
            }
        }
    }
    // A run stopped before its last step (cancelled) leaves a checkpoint of where it stopped,
    // never one called final.
    let taken = streamer.taken();
    let final_dir = if taken >= steps {
        options.out.join("final")
    } else {
        options.out.join(format!("checkpoint-{taken}"))
    };
    save(&mut streamer, cursor, &final_dir)?;
    streamer.finish()?;
    observer.event(&Event::Saved { path: final_dir.clone(), step: streamer.taken() });
    Ok(RunSummary {
        steps: streamer.taken(),
        first_loss,
        last_loss,
        data: packed.stats,
        final_checkpoint: final_dir,
    })
}
