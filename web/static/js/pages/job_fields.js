// Reading a job as `GET /api/jobs` and `GET /api/jobs/{id}` send it, in one place.
import { fmtDuration, fmtNum } from '../ui.js';

/** `{step, steps, fraction}`; fraction is 0..1. `total_steps` is 0 until a one-pass job starts. */
export function jobProgress(job) {
  const step = num(job.step) ?? 0;
  const steps = num(job.total_steps) || num(job.config && job.config.steps) || 0;
  let fraction = num(job.progress) ?? (steps > 0 ? step / steps : 0);
  if (job.status === 'completed') fraction = 1;
  return { step, steps, fraction: Math.max(0, Math.min(1, fraction)) };
}

/** The 1-based place in the device's line while queued, or null. */
export function queuePosition(job) {
  return job.status === 'queued' ? (num(job.position) ?? null) : null;
}

/** "next in line", "3rd in line". */
export function placeInLine(position) {
  if (position === null) return 'waiting';
  if (position <= 1) return 'next in line';
  const suffix = position % 10 === 2 && position % 100 !== 12 ? 'nd' : position % 10 === 3 && position % 100 !== 13 ? 'rd' : 'th';
  return `${position}${suffix} in line`;
}

/** `preset:tiny` -> "tiny", `local:Qwen3-8B` -> "Qwen3-8B". */
export function modelLabel(id) {
  if (typeof id !== 'string') return '—';
  return id.replace(/^(preset|local):/, '');
}

/**
 * The question before deleting a dataset: it names the cancelled or interrupted jobs
 * (`GET /api/datasets/{id}/resumable-jobs`) that lose their resume with it.
 */
export function datasetDeleteQuestion(dataset, resumable) {
  const base = `Delete the dataset “${dataset.name}”? Jobs that already used it keep their results and checkpoints.`;
  if (!Array.isArray(resumable) || !resumable.length) return base;
  const names = resumable.map((j) => (j.name ? `${j.name} (#${j.id})` : `job #${j.id}`));
  const which = names.length === 1 ? names[0] : `${names.slice(0, -1).join(', ')} and ${names[names.length - 1]}`;
  return `${base}\n\n${which} can no longer be resumed: a resume reads the same data again.`;
}

/** Whether the job can be resumed (the server says so when it knows). */
export function canResume(job) {
  if (typeof job.resumable === 'boolean') return job.resumable;
  return job.status === 'interrupted' || job.status === 'cancelled';
}

/**
 * A device as the API names it: "cpu", "cuda:0", or several GPUs of the host for data
 * parallelism, "cuda:0,1". `cuda:0,1` -> "2 GPUs (cuda:0,1)".
 */
export function deviceLabel(id) {
  if (typeof id !== 'string' || !id) return '—';
  const gpus = gpuIndices(id);
  return gpus.length > 1 ? `${gpus.length} GPUs (${id})` : id;
}

/** `cuda:0,1` -> [0, 1]; `cuda:3` -> [3]; `cpu` -> []. */
export function gpuIndices(id) {
  const match = /^cuda:(\d+(?:,\d+)*)$/.exec(id || '');
  return match ? match[1].split(',').map(Number) : [];
}

// The settings of a job (`config` in the API), in the order the new-job form asks for them,
// with what the engine does when one is left empty; units as [one, many].
const STEPS = ['step', 'steps'];
const SETTINGS = [
  { key: 'steps', label: 'Steps', none: 'one pass over the data', format: 'int' },
  { key: 'seq_len', label: 'Sequence length', format: 'int', unit: ['token', 'tokens'] },
  { key: 'micro_batch', label: 'Micro-batch', format: 'int', unit: ['row', 'rows'] },
  { key: 'grad_accum', label: 'Accumulation', format: 'int', unit: ['micro-batch', 'micro-batches'] },
  { key: 'lr', label: 'Learning rate', none: 'the default for the model' },
  { key: 'schedule', label: 'Schedule' },
  { key: 'warmup', label: 'Warmup', format: 'int', unit: STEPS },
  { key: 'weight_decay', label: 'Weight decay' },
  { key: 'max_grad_norm', label: 'Clip grad norm', zero: 'off' },
  { key: 'gradients', label: 'Gradients wait', none: 'auto' },
  { key: 'moments', label: 'Adam moments', none: 'auto' },
  { key: 'seed', label: 'Seed', format: 'plain' },
  { key: 'train_on_prompt', label: 'Train on prompts' },
  { key: 'save_every', label: 'Save every', none: 'only at the end', format: 'int', unit: STEPS },
  { key: 'save_dtype', label: 'Checkpoint precision' },
  { key: 'eval_every', label: 'Evaluate every', none: 'never', format: 'int', unit: STEPS },
  { key: 'held_out', label: 'Held-out share', format: 'share' },
  { key: 'eval_metric', label: 'Eval metric' },
  { key: 'eval_answer', label: 'Answer format' },
  { key: 'eval_pattern', label: 'Answer pattern', none: '—' },
  { key: 'eval_max_new_tokens', label: 'Answer length', format: 'int', unit: ['token', 'tokens'] },
  { key: 'eval_records', label: 'Records scored', format: 'int', unit: ['record', 'records'] },
];

// The task evaluation's metrics as the pages name and explain them (the engine's
// `eval_metric` choices; `loss` is the held-out loss alone).
export const METRICS = {
  loss: { label: 'Loss only', help: 'the held-out loss alone: how well the model predicts the references; no answers are written' },
  exact_match: { label: 'Exact match', help: 'the answer must equal the reference, ignoring case, punctuation, articles and spacing' },
  contains: { label: 'Contains', help: 'the reference must appear somewhere in the answer' },
  extract: { label: 'Final answer', help: 'a final answer is pulled out of the output (a number, after ####, in \\boxed{} or by your pattern) and must equal the reference\'s' },
  rouge_l: { label: 'ROUGE-L', help: 'word overlap with the reference (longest common subsequence), 0 to 1: for summaries and free text' },
  bleu: { label: 'BLEU', help: 'n-gram overlap with the references over the whole set, 0 to 100: for translation' },
  choice: { label: 'Multiple choice', help: 'the choice the model finds most likely must be the right one; needs an evaluation dataset of questions with choices' },
  perplexity: { label: 'Perplexity', help: 'how surprised the model is by the references after their prompts; lower is better' },
};

// How `extract` finds the final answer (the engine's `eval_answer` choices).
export const ANSWER_FORMATS = {
  gsm8k: { label: 'After ####', help: 'the number after ####, as GSM8K writes its answers' },
  last_number: { label: 'Last number', help: 'the last number in the output' },
  boxed: { label: 'Boxed', help: 'the content of the last \\boxed{...}' },
  regex: { label: 'Your pattern', help: 'your regular expression: its first group (or the whole match), at its last match in the output' },
};

/** "Exact match" for `exact_match`; the name itself for one the page does not know. */
export function metricLabel(metric) {
  return (METRICS[metric] && METRICS[metric].label) || String(metric || '—');
}

/** A task evaluation's figure: BLEU on its 0-100 scale with one decimal, others to 4 digits. */
export function fmtScore(metric, value) {
  if (typeof value !== 'number' || !Number.isFinite(value)) return '—';
  if (metric === 'bleu') return value.toFixed(1);
  return fmtNum(value);
}

/**
 * The settings that matter to this job's evaluation: the held-out share without an evaluation
 * dataset of its own, the answer format with `extract`, its pattern with `regex`, and the
 * answers' length and count with a task metric.
 */
function relevant(key, config, hasEvalDataset) {
  const metric = config.eval_metric;
  const task = typeof metric === 'string' && metric !== 'loss';
  switch (key) {
    case 'held_out': return !hasEvalDataset && (typeof config.eval_every === 'number' || task);
    case 'eval_answer': return metric === 'extract';
    case 'eval_pattern': return metric === 'extract' && config.eval_answer === 'regex';
    case 'eval_max_new_tokens': return ['exact_match', 'contains', 'extract', 'rouge_l', 'bleu'].includes(metric);
    case 'eval_records': return task;
    default: return true;
  }
}

/**
 * `[{key, label, value}]` for a job's `config`: the known settings first, in the form's order,
 * then any others the server sends, by name. Values are text. `saveInterval` is the job's
 * `save_interval`: the steps between checkpoints the run keeps when `save_every` is empty.
 */
export function settingsList(config, saveInterval = null, hasEvalDataset = false) {
  if (!config || typeof config !== 'object') return [];
  const known = new Set(SETTINGS.map((s) => s.key));
  const extra = Object.keys(config).filter((k) => !known.has(k)).sort().map((key) => ({ key, label: key }));
  return [...SETTINGS.filter((s) => s.key in config && relevant(s.key, config, hasEvalDataset)), ...extra]
    .map((s) => {
      const chosen = s.key === 'save_every' && (config.save_every === null || config.save_every === undefined) && num(saveInterval);
      const value = chosen ? `${settingText(s, saveInterval)} (about five saves over the run)`
        : s.key === 'eval_metric' ? metricLabel(config[s.key])
          : s.key === 'eval_answer' ? ((ANSWER_FORMATS[config[s.key]] || {}).label || String(config[s.key]))
            : settingText(s, config[s.key]);
      return { key: s.key, label: s.label, value };
    });
}

function settingText(setting, value) {
  if (value === null || value === undefined) return setting.none || '—';
  if (typeof value === 'boolean') return value ? 'yes' : 'no';
  if (typeof value === 'number') {
    if (value === 0 && setting.zero) return setting.zero;
    if (setting.format === 'share') return `${Number(value.toPrecision(6))} (${Number((value * 100).toPrecision(3))}%)`;
    // Rates arrive as f32 widened to f64 (1e-3 as 0.0010000000474974513): 6 digits say it all.
    const text = setting.format === 'int' ? value.toLocaleString('en-US')
      : Number.isInteger(value) || setting.format === 'plain' ? String(value) : String(Number(value.toPrecision(6)));
    return setting.unit ? `${text} ${setting.unit[value === 1 ? 0 : 1]}` : text;
  }
  if (typeof value === 'object') return JSON.stringify(value);
  return String(value);
}

function num(value) {
  return typeof value === 'number' && Number.isFinite(value) ? value : undefined;
}

/** A job's duration as the API gives it: whole seconds (job times are kept to the second). */
export function runDuration(job) {
  if (typeof job.duration_s !== 'number') return '—';
  return job.duration_s < 1 ? 'under 1 s' : fmtDuration(job.duration_s);
}
