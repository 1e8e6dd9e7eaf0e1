// One job: status, progress and ETA; its settings, placement, disk use and equivalent command;
// live charts fed by server-sent events on top of the stored history (so a reload loses
// nothing), the task evaluation's metric among them with the base model's figure as a line;
// the answers of the base model and of the tuned one, record by record; the log; checkpoints to
// download, or to chat with (the answer streams in as it is written), alone or beside the model
// the job started from; cancel and resume (which continues from the saved training state
// exactly). A summary (times, losses, the metric before → after, tokens, throughput) with the
// job's name and note, "run again", and deletes of the job or of single checkpoints that say
// what they free.
import { ApiError, del, firstData, get, post, postStream, request, requireUser } from '../api.js';
import { MetricChart } from '../charts.js';
import { renderTimeline } from '../timeline.js';
import { $, copyText, debounce, el, fill, fmtBytes, fmtDate, fmtDuration, fmtInt, fmtNum, idFromPath, showError, statusBadge } from '../ui.js';
import { canResume, deviceLabel, fmtScore, gpuIndices, jobProgress, metricLabel, modelLabel, placeInLine, queuePosition, runDuration, settingsList } from './job_fields.js';
import { renderAnswers } from './answers.js';

const me = await requireUser();
const id = idFromPath();
const error = $('#error');
const TERMINAL = new Set(['completed', 'failed', 'cancelled', 'interrupted']);
const MAX_LOG_LINES = 3000;

const gbps = (v) => `${fmtNum(v)} GB/s`;
const CHARTS = [
  { key: 'loss', title: 'Loss', unit: 'loss', series: [{ field: 'loss', label: 'train' }, { field: 'eval_loss', label: 'eval', sparse: true }], format: fmtNum },
  { key: 'lr', title: 'Learning rate', unit: 'learning rate', series: [{ field: 'lr', label: 'lr' }], format: fmtNum },
  { key: 'grad_norm', title: 'Gradient norm', unit: 'norm', series: [{ field: 'grad_norm', label: 'norm' }], format: fmtNum },
  { key: 'tokens_per_s', title: 'Tokens per second', unit: 'tokens/s', series: [{ field: 'tokens_per_s', label: 'tokens/s' }], format: fmtNum },
  { key: 'tflops', title: 'TFLOPS', unit: 'TFLOPS', series: [{ field: 'tflops', label: 'TFLOPS' }], format: fmtNum },
  { key: 'gpu_mem', title: 'GPU memory', unit: 'bytes', gpuOnly: true, series: [{ field: 'gpu_mem', label: 'in use' }], format: fmtBytes },
  { key: 'pcie', title: 'PCIe transfer', unit: 'GB/s', gpuOnly: true, series: [{ field: 'h2d_gbps', label: 'host → GPU' }, { field: 'd2h_gbps', label: 'GPU → host' }], format: gbps },
  { key: 'host_mem', title: 'Host memory', unit: 'bytes', series: [{ field: 'host_mem', label: 'in use' }], format: fmtBytes },
  // Exposed: what the step waited for; the rest ran behind the GPU's work.
  { key: 'optimizer_s', title: 'Optimizer time per step', unit: 'seconds', series: [{ field: 'optimizer_s', label: 'total' }, { field: 'optimizer_exposed_s', label: 'exposed (the step waited)' }], format: fmtDuration },
];

/**
 * The task evaluation's chart: the figure at each evaluation, and the base model's (step 0) as
 * a dashed line across it.
 */
function taskChart(task) {
  const label = metricLabel(task.metric);
  return {
    key: 'task_score',
    title: `${label}${task.higher_is_better ? '' : ' (lower is better)'}`,
    unit: task.metric === 'bleu' ? 'BLEU' : label.toLowerCase(),
    series: [{ field: 'task_score', label: 'this run', sparse: true }],
    baseline: { field: 'task_score', label: 'base model' },
    format: (v) => fmtScore(task.metric, v),
  };
}

let job = null;
let source = null;
const points = new Map(); // step -> merged point
let sorted = [];
let charts = [];
let drawQueued = false;
let fetchedTimeline = null; // {step, timeline} of the latest stored step that has one
let shownTimeline = null;

// --- metric points ---------------------------------------------------------------------------

/** Merges a point into the history; eval points may arrive separately for a step. */
function addPoint(point) {
  if (!point || typeof point.step !== 'number') return;
  const old = points.get(point.step);
  if (old) {
    for (const [k, v] of Object.entries(point)) if (v !== null && v !== undefined) old[k] = v;
  } else {
    points.set(point.step, { ...point });
  }
}

function scheduleDraw() {
  if (drawQueued) return;
  drawQueued = true;
  requestAnimationFrame(() => {
    drawQueued = false;
    sorted = [...points.values()].sort((a, b) => a.step - b.step);
    for (const chart of charts) chart.update(sorted);
    // Live points carry their timeline; the stored history does not (it is fetched per step).
    const withTimeline = [...sorted].reverse().find((p) => p.timeline) || fetchedTimeline;
    if (withTimeline && withTimeline !== shownTimeline) {
      shownTimeline = withTimeline;
      renderTimeline($('#timeline'), withTimeline.timeline, withTimeline.step, Boolean(job) && gpuIndices(job.gpu).length > 0);
      $('#timeline-title').textContent = `Stream timeline of step ${fmtInt(withTimeline.step)}`;
    }
    renderSummary();
  });
}

// --- job header and summary ------------------------------------------------------------------

function fact(label, value, key) {
  return el('div', { class: 'fact', dataset: { fact: key } }, el('div', { class: 'k' }, label), el('div', { class: 'v' }, value));
}

// The demo link: on (a link to open or copy, and a button to end it) or off.
function renderDemo() {
  const link = $('#demo-link');
  const on = Boolean(job.demo);
  link.hidden = !on;
  $('#demo-off').hidden = !on;
  $('#demo-on').hidden = on;
  if (on) {
    link.href = job.demo;
    link.textContent = new URL(job.demo, location.origin).href;
  }
}

function renderJob() {
  if (!job) return;
  renderDemo();
  const title = job.name ? `${job.name} (#${id})` : `Job #${id}`;
  document.title = `${title} · Sluice`;
  $('#title').textContent = title;
  $('#run-again').href = `/jobs/new?from=${id}`;
  $('#delete-job').hidden = !TERMINAL.has(job.status);
  $('#delete-job').textContent = `Delete (frees ${fmtBytes(job.disk_bytes || 0)})`;
  renderLabel();
  fill($('#status'), statusBadge(job.status));
  $('#subtitle').textContent = [modelLabel(job.model), job.dataset_name, deviceLabel(job.gpu), me.role === 'admin' && job.owner ? `owner ${job.owner}` : null, `created ${fmtDate(job.created_at)}`]
    .filter(Boolean).join(' · ');
  $('#cancel').hidden = !(job.status === 'queued' || job.status === 'running');
  $('#resume').hidden = !canResume(job);
  // A job stopped early whose resume is gone says why, where the Resume button would be.
  const blocked = typeof job.resume_blocked === 'string' ? job.resume_blocked : '';
  $('#resume-note').textContent = blocked ? `Resume unavailable: ${blocked}.` : '';
  $('#resume-note').hidden = !blocked;
  const failure = $('#job-failure');
  if (job.error && (job.status === 'failed' || job.status === 'interrupted')) {
    failure.textContent = job.error;
    failure.hidden = false;
  } else {
    failure.hidden = true;
  }
  renderSettings();
  renderSummary();
  renderRunSummary();
}

// Rebuilt only when it changes, so a selection in it survives the periodic refresh.
let shownSettings = null;

/** The settings the job runs with, the placement that ran, what it evaluates on, its command. */
function renderSettings() {
  const config = job.config && typeof job.config === 'object' ? job.config : {};
  const placement = typeof job.placement === 'string' ? job.placement : '';
  $('#job-placement-text').textContent = placement;
  $('#job-placement').hidden = !placement;

  let evaluation = '';
  if (job.eval_dataset !== null && job.eval_dataset !== undefined) {
    evaluation = job.eval_dataset_name || `dataset ${job.eval_dataset}`;
  } else if ((typeof config.eval_every === 'number' || job.task) && typeof config.held_out === 'number') {
    evaluation = `${Number((config.held_out * 100).toPrecision(3))}% of ${job.dataset_name || 'the training data'}, held out`;
  }
  $('#job-eval-text').textContent = evaluation;
  $('#job-eval').hidden = !evaluation;

  // The held-out share matters only to a job that evaluates without a dataset of its own.
  const rows = settingsList(config, job.save_interval, job.eval_dataset !== null && job.eval_dataset !== undefined);
  const key = JSON.stringify(rows);
  if (key !== shownSettings) {
    shownSettings = key;
    fill($('#settings'), rows.map((row) => el('div', { dataset: { setting: row.key } },
      el('dt', { title: row.key }, row.label), el('dd', {}, row.value))));
  }

  const command = typeof job.command === 'string' ? job.command : '';
  if ($('#job-command').textContent !== command) $('#job-command').textContent = command;
  $('#job-command-box').hidden = !command;
}

/**
 * The task evaluation as "before → after": the base model's figure (step 0) and the latest
 * evaluation's, live from the points.
 */
function taskText(task) {
  const before = points.get(0);
  const base = before && typeof before.task_score === 'number' ? before.task_score : null;
  const latest = [...sorted].reverse().find((p) => p.step > 0 && typeof p.task_score === 'number');
  if (base === null && !latest) return '—';
  const show = (v) => fmtScore(task.metric, v);
  if (!latest) return `${show(base)} (base model)`;
  return base === null ? show(latest.task_score) : `${show(base)} → ${show(latest.task_score)}`;
}

/**
 * The latest held-out loss, and where it started: the run evaluates before its first step
 * (a point of step 0), so the untrained model's loss is the figure to compare with.
 */
function evalText(latest) {
  if (!latest) return '—';
  const before = points.get(0);
  if (latest.step === 0) return `${fmtNum(latest.eval_loss)} (before training)`;
  return before && typeof before.eval_loss === 'number'
    ? `${fmtNum(latest.eval_loss)} (from ${fmtNum(before.eval_loss)})`
    : fmtNum(latest.eval_loss);
}

function renderSummary() {
  if (!job) return;
  const { step: jobStep, steps, fraction } = jobProgress(job);
  const last = sorted[sorted.length - 1];
  const step = Math.max(jobStep, last ? last.step : 0);
  const shown = steps ? Math.max(fraction, step / steps) : fraction;
  $('#progress-bar > span').style.width = `${Math.min(1, shown) * 100}%`;
  $('#progress-text').textContent = steps ? `step ${fmtInt(step)} of ${fmtInt(steps)}` : '';
  const position = queuePosition(job);
  let eta = '—';
  if (job.status === 'running') eta = typeof job.eta_s === 'number' ? fmtDuration(job.eta_s) : 'measuring…';
  else if (job.status === 'queued') eta = placeInLine(position);
  else if (job.status === 'completed') eta = 'done';
  const lossPoint = [...sorted].reverse().find((p) => typeof p.loss === 'number');
  const evalPoint = [...sorted].reverse().find((p) => typeof p.eval_loss === 'number');
  const speed = last && typeof last.tokens_per_s === 'number' ? `${fmtNum(last.tokens_per_s)} tok/s` : '—';
  fill($('#summary'),
    fact(job.status === 'queued' ? 'In line' : 'Time left', eta, 'eta'),
    fact('Loss', lossPoint ? fmtNum(lossPoint.loss) : '—', 'loss'),
    fact('Eval loss', evalText(evalPoint), 'eval_loss'),
    job.task ? fact(metricLabel(job.task.metric), taskText(job.task), 'task_score') : null,
    fact('Speed', speed, 'speed'),
    fact('Disk used', fmtBytes(job.disk_bytes), 'disk'),
    fact('Points', fmtInt(sorted.length), 'points'));
}

// The label fields are filled from the job until the person edits them.
let labelEdited = false;

function renderLabel() {
  if (labelEdited) return;
  $('#job-name').value = job.name || '';
  $('#job-note').value = job.note || '';
}

/** Settings that tell runs apart at a glance, on one line. */
function settingsLine(config) {
  const c = config && typeof config === 'object' ? config : {};
  const n = (v) => (typeof v === 'number' ? Number(v.toPrecision(6)) : v);
  return [
    typeof c.steps === 'number' ? `${fmtInt(c.steps)} steps` : 'one pass',
    typeof c.seq_len === 'number' ? `${fmtInt(c.seq_len)} tokens per row` : null,
    typeof c.micro_batch === 'number' ? `batch ${c.micro_batch} × ${c.grad_accum ?? 1}` : null,
    c.lr !== undefined && c.lr !== null ? `lr ${n(c.lr)}` : null,
    c.schedule ? `${c.schedule} schedule` : null,
    typeof c.seed === 'number' ? `seed ${c.seed}` : null,
  ].filter(Boolean).join(' · ');
}

/** The run as a whole: when it ran, how it ended, what it saw. */
function renderRunSummary() {
  const s = job.summary || {};
  const loss = (v) => (typeof v === 'number' ? fmtNum(v) : '—');
  const at = (step) => (typeof step === 'number' ? ` (step ${fmtInt(step)})` : '');
  const time = (t) => (t ? fmtDate(t) : '—');
  $('#run-settings-line').textContent = [modelLabel(job.model), job.dataset_name, deviceLabel(job.gpu)].filter(Boolean).join(' · ')
    + ' — ' + settingsLine(job.config);
  fill($('#run-summary'),
    fact('Queued', time(job.created_at), 'queued'),
    fact('Started', time(job.started_at), 'started'),
    fact('Finished', time(job.finished_at), 'finished'),
    fact('Duration', runDuration(job), 'duration'),
    // Only an ended run has a final loss; until then it is the latest.
    fact(TERMINAL.has(job.status) ? 'Final loss' : 'Latest loss', loss(s.final_loss), 'final_loss'),
    fact('Best loss', `${loss(s.best_loss)}${at(s.best_loss_step)}`, 'best_loss'),
    fact('Eval loss', typeof s.final_eval_loss === 'number' ? `${loss(s.final_eval_loss)}, best ${loss(s.best_eval_loss)}${at(s.best_eval_step)}` : '—', 'summary_eval_loss'),
    job.task ? fact(`${metricLabel(job.task.metric)}, base → tuned`, beforeAfter(job.task, s), 'summary_task') : null,
    fact('Tokens seen', typeof s.tokens_seen === 'number' ? fmtInt(s.tokens_seen) : '—', 'tokens_seen'),
    fact('Throughput', typeof s.tokens_per_s === 'number' ? `${fmtNum(s.tokens_per_s)} tok/s` : '—', 'throughput'));
}

/** The summary's task figure: the base model's, then the latest evaluation's (with its step). */
function beforeAfter(task, s) {
  const show = (v) => fmtScore(task.metric, v);
  const has = (v) => typeof v === 'number';
  if (!has(s.task_before) && !has(s.task_score)) return '—';
  const after = has(s.task_score) ? `${show(s.task_score)} (step ${fmtInt(s.task_step)})` : 'not yet';
  return `${has(s.task_before) ? show(s.task_before) : '—'} → ${after}`;
}

async function loadTimeline() {
  try {
    const found = await get(`/api/jobs/${id}/timeline`);
    if (found && Array.isArray(found.timeline) && typeof found.step === 'number') {
      fetchedTimeline = { step: found.step, timeline: found.timeline };
      scheduleDraw();
    }
  } catch {
    // The timeline is an extra: without it the panel keeps its explanation.
  }
}

function notice(text) {
  const box = $('#notice');
  box.textContent = text;
  box.hidden = !text;
}

async function refreshJob() {
  job = firstData('job') ?? (await get(`/api/jobs/${id}`));
  renderJob();
  return job;
}

// --- checkpoints -----------------------------------------------------------------------------

// Weights download in bf16 by default (half the size of f32, what transformers loads as is);
// the f32 link sends a safetensors file as it was saved.
function fileUrl(checkpoint, file, dtype = 'bf16') {
  const url = `/api/jobs/${id}/checkpoints/${encodeURIComponent(checkpoint.name)}/files/${encodeURIComponent(file.name)}`;
  return file.name.endsWith('.safetensors') ? `${url}?dtype=${dtype}` : url;
}

function checkpointUrl(checkpoint, what) {
  return `/api/jobs/${id}/checkpoints/${encodeURIComponent(checkpoint.name)}/${what}`;
}

async function refreshCheckpoints() {
  let list;
  try {
    list = await get(`/api/jobs/${id}/checkpoints`);
  } catch (err) {
    if (err.status !== 404) showError(error, err);
    return;
  }
  const box = $('#checkpoints');
  if (!list.length) {
    fill(box, el('p', { class: 'empty' }, job && job.status === 'running' ? 'None yet: the first is saved as the run goes.' : 'None.'));
    return;
  }
  const byStep = [...list].sort((a, b) => (b.step ?? 0) - (a.step ?? 0));
  renderTryChoices(byStep);
  fill(box, byStep.map((c) => {
    const total = (c.files || []).reduce((sum, f) => sum + (f.size || 0), 0);
    return el('div', { class: 'checkpoint', dataset: { checkpoint: c.name } },
      el('div', { class: 'buttons', style: { justifyContent: 'space-between' } },
        el('div', {}, el('strong', {}, c.name), el('span', { class: 'small muted' }, ` · step ${fmtInt(c.step)} · ${fmtBytes(total)}`)),
        el('div', { class: 'buttons' },
          el('a', { class: 'btn small', href: checkpointUrl(c, 'archive?dtype=bf16'), download: `job-${id}-${c.name}.tar`, dataset: { archive: c.name } }, 'Download all (.tar, bf16)'),
          el('a', { class: 'btn small', href: checkpointUrl(c, 'gguf?type=q8_0'), download: `job-${id}-${c.name}-q8_0.gguf`, dataset: { gguf: c.name }, title: 'One file for llama.cpp and Ollama (8-bit)' }, 'GGUF (Q8_0)'),
          el('a', { class: 'small', href: checkpointUrl(c, 'gguf?type=f16'), download: `job-${id}-${c.name}-f16.gguf` }, 'F16'),
          el('a', { class: 'small', href: checkpointUrl(c, 'archive?dtype=f32'), download: `job-${id}-${c.name}-f32.tar` }, 'as saved (.tar)'),
          job && job.status !== 'running'
            ? el('button', { type: 'button', class: 'small danger', dataset: { deleteCheckpoint: c.name }, onclick: () => deleteCheckpoint(c, total) }, `Delete (frees ${fmtBytes(total)})`)
            : null)),
      el('details', {}, el('summary', { class: 'small muted' }, `${(c.files || []).length} files`),
        el('ul', { class: 'files' }, (c.files || []).map((f) => el('li', {},
          el('a', { href: fileUrl(c, f), download: f.name }, f.name),
          f.name.endsWith('.safetensors') ? el('a', { class: 'small', href: fileUrl(c, f, 'f32'), download: f.name }, ' (as saved)') : null,
          el('span', { class: 'muted num' }, fmtBytes(f.size)))))));
  }));
}

async function deleteCheckpoint(checkpoint, bytes) {
  if (!confirm(`Delete ${checkpoint.name}? This frees ${fmtBytes(bytes)}; its files cannot be downloaded or tried afterwards.`)) return;
  try {
    const done = await del(`/api/jobs/${id}/checkpoints/${encodeURIComponent(checkpoint.name)}`);
    notice(`Deleted ${checkpoint.name}: ${fmtBytes(done.freed_bytes)} freed.`);
    await refreshJob();
    await refreshCheckpoints();
  } catch (err) {
    showError(error, err);
  }
}

// --- try a checkpoint: a small chat ----------------------------------------------------------

const NO_CHAT_TEMPLATE = 'This checkpoint has no chat template: the prompt is continued as plain text.';
// What the server is sent each time: every user turn and the model's answers ("assistant"), in
// order. A new conversation starts with a new array, so an answer still arriving for the old one
// cannot land in it.
let conversation = [];
// Beside the base model, its own history: the same user turns, its own answers.
let baseConversation = [];
// The answer being written, while one is: { controller, turn }.
let streaming = null;

/** Whether each message is also answered by the model the job started from. */
function comparing() {
  const box = $('#try-base');
  return box.checked && !box.disabled;
}

// The list is rebuilt only when the checkpoints change, so a choice (and the typed message and
// the conversation, which live outside the list) survive the periodic refresh.
function renderTryChoices(checkpoints) {
  const select = $('#try-checkpoint');
  const names = checkpoints.map((c) => c.name);
  const current = [...select.options].map((o) => o.value);
  $('#try').hidden = names.length === 0;
  if (names.join('\n') === current.join('\n')) return;
  const chosen = select.value;
  fill(select, names.map((n) => el('option', { value: n }, n)));
  if (names.includes(chosen)) select.value = chosen;
  else if (conversation.length || streaming) newConversation();
}

function userTurn(text) {
  return el('div', { class: 'turn user', dataset: { role: 'user' } },
    el('h3', { class: 'role' }, 'You'),
    el('div', { class: 'body' }, text));
}

/**
 * The model's turn: grows token by token, then shows where it ran and how fast. `followsTurns`:
 * whether earlier turns came before it (which a checkpoint without a chat template ignores).
 */
class ModelTurn {
  /**
   * `who` heads the turn ("Model", or beside the base model "Checkpoint final"); `model` is
   * `checkpoint` or `base`, for the page's test.
   */
  constructor(followsTurns, who = 'Model', model = 'checkpoint') {
    this.text = '';
    this.device = null;
    this.textNode = el('span', { class: 'text' });
    this.caret = el('span', { class: 'caret', 'aria-hidden': 'true' });
    this.chatNote = el('p', { class: 'note small muted', hidden: true },
      followsTurns ? `${NO_CHAT_TEMPLATE} Only your last message is used.` : NO_CHAT_TEMPLATE);
    this.stats = el('p', { class: 'stats small muted' }, model === 'base' ? 'Waiting for its turn…' : 'Loading the checkpoint…');
    this.deviceNote = el('p', { class: 'device-note small muted', hidden: true });
    this.node = el('div', { class: 'turn model', dataset: { role: 'assistant', state: 'streaming', model } },
      el('h3', { class: 'role' }, who),
      el('div', { class: 'body' }, this.textNode, this.caret),
      this.chatNote, this.stats, this.deviceNote);
  }

  /** `start` and `done` both say where it runs and whether the chat template is used. */
  describe(info) {
    if (typeof info.device === 'string') this.device = info.device;
    if (typeof info.chat === 'boolean') this.chatNote.hidden = info.chat;
    if ('device_note' in info) {
      this.deviceNote.textContent = info.device_note || '';
      this.deviceNote.hidden = !info.device_note;
    }
    if (this.device) this.stats.dataset.device = this.device;
  }

  start(info) {
    this.describe(info || {});
    this.stats.textContent = this.device ? `Writing on ${deviceLabel(this.device)}…` : 'Writing…';
  }

  append(text) {
    if (typeof text !== 'string' || !text) return;
    this.text += text;
    this.textNode.textContent = this.text;
  }

  finish(done) {
    this.describe(done);
    if (typeof done.text === 'string') this.text = done.text;
    this.end('done', this.text ? null : '(the model ended at once, with no text)');
    const tokens = typeof done.tokens === 'number' ? done.tokens : null;
    this.stats.textContent = [
      deviceLabel(this.device),
      tokens === null ? null : `${fmtInt(tokens)} ${tokens === 1 ? 'token' : 'tokens'}`,
      typeof done.tokens_per_s === 'number' ? `${fmtNum(done.tokens_per_s)} tokens/s` : null,
      typeof done.seconds === 'number' ? fmtDuration(done.seconds) : null,
      done.stopped_at_eos === false ? 'cut at the New tokens limit' : null,
    ].filter(Boolean).join(' · ');
  }

  /** Stopped by the person (`stopped`) or by a failure (`failed`): the partial text stays. */
  interrupt(state) {
    this.end(state, this.text ? null : '(no text yet)');
    const what = state === 'stopped' ? 'Stopped' : 'Broke off';
    this.stats.textContent = [`${what}: the answer is incomplete`, this.device ? deviceLabel(this.device) : null]
      .filter(Boolean).join(' · ');
  }

  /** Refused before any text (no base model, a busy device): the server's reason, in place. */
  refuse(message) {
    this.end('failed', '(no answer)');
    this.stats.textContent = message;
  }

  end(state, placeholder) {
    this.node.dataset.state = state;
    this.caret.remove();
    this.textNode.textContent = this.text;
    if (placeholder) this.textNode.append(el('span', { class: 'muted' }, placeholder));
  }
}

/**
 * Runs `change` on the conversation and keeps its newest text in view, unless the person had
 * scrolled up to read (or `force`).
 */
function followConversation(change, force = false) {
  const view = $('#try-conversation');
  const atEnd = view.scrollHeight - view.scrollTop - view.clientHeight < 40;
  change();
  if (force || atEnd) view.scrollTop = view.scrollHeight;
}

function setStreaming(on) {
  $('#try-send').disabled = on;
  $('#try-stop').hidden = !on;
  $('#try-checkpoint').disabled = on;
  $('#try-base').disabled = on || !baseAvailable;
  $('#try-new').disabled = !on && conversation.length === 0;
  // Screen readers announce the finished answer once instead of every token.
  $('#try-conversation').setAttribute('aria-busy', on ? 'true' : 'false');
}

function newConversation() {
  if (streaming) streaming.controller.abort();
  conversation = [];
  baseConversation = [];
  fill($('#try-conversation'));
  showError($('#try-error'), null);
  $('#try-new').disabled = !streaming;
}

/**
 * Streams one answer to `messages` from `url` into `turn`: `{done, failure}`, `done` being the
 * final message when the answer completed.
 */
async function answerInto(url, messages, turn, controller) {
  let done = null;
  let failure = null;
  try {
    await postStream(url, {
      messages: [...messages],
      max_new_tokens: Number($('#try-tokens').value) || 64,
      temperature: Number($('#try-temperature').value) || 0,
      stream: true,
    }, (event, data) => {
      if (done || failure || !data || typeof data !== 'object') return;
      if (event === 'start') followConversation(() => turn.start(data));
      else if (event === 'token') followConversation(() => turn.append(data.text));
      else if (event === 'done') done = data;
      else if (event === 'error') failure = new ApiError(500, String(data.error || 'The generation failed.'));
    }, { signal: controller.signal });
    if (!done && !failure) failure = new ApiError(0, 'The answer broke off before it was complete.');
  } catch (err) {
    failure = err;
  }
  return { done, failure };
}

const aborted = (failure) => Boolean(failure) && failure.name === 'AbortError';

async function send() {
  const input = $('#try-message');
  const name = $('#try-checkpoint').value;
  const text = input.value;
  if (streaming || !name) return;
  if (!text.trim()) {
    input.focus();
    return;
  }
  const errorBox = $('#try-error');
  showError(errorBox, null);
  const compare = comparing();
  const messages = conversation;
  const baseMessages = baseConversation;
  messages.push({ role: 'user', content: text });
  if (compare) baseMessages.push({ role: 'user', content: text });
  const user = userTurn(text);
  const turn = new ModelTurn(messages.length > 1, compare ? `Checkpoint ${name}` : 'Model', 'checkpoint');
  // Beside the base model, the two answers side by side: the base model's first, as it came first.
  const baseTurn = compare ? new ModelTurn(baseMessages.length > 1, 'Base model', 'base') : null;
  const answers = compare ? el('div', { class: 'pair', dataset: { pair: String(messages.length) } }, baseTurn.node, turn.node) : turn.node;
  followConversation(() => $('#try-conversation').append(user, answers), true);
  input.value = '';
  const controller = new AbortController();
  streaming = { controller, turn };
  setStreaming(true);

  // One model at a time: the checkpoint, then the base model on the same conversation.
  const { done, failure } = await answerInto(`/api/jobs/${id}/checkpoints/${encodeURIComponent(name)}/generate`, messages, turn, controller);
  let base = null;
  if (compare && !aborted(failure) && (done || turn.text)) {
    streaming.turn = baseTurn;
    base = await answerInto(`/api/jobs/${id}/base-model/generate`, baseMessages, baseTurn, controller);
  }

  const current = messages === conversation;
  let shownFailure = failure && !aborted(failure) ? failure : null;
  followConversation(() => {
    if (done) {
      turn.finish(done);
    } else if (aborted(failure)) {
      turn.interrupt('stopped');
    } else if (!turn.text) {
      // Refused or failed before any text (a wrong setting, a busy server, a checkpoint that
      // cannot generate): the turn is taken back and the message put back to edit or send again.
      user.remove();
      answers.remove();
      if (current) {
        messages.pop();
        if (compare) baseMessages.pop();
        if (!input.value) input.value = text;
      }
    } else {
      turn.interrupt('failed');
    }
    if (!baseTurn || !answers.isConnected) return;
    if (base && base.done) {
      baseTurn.finish(base.done);
    } else if (base && aborted(base.failure)) {
      baseTurn.interrupt('stopped');
    } else if (base && baseTurn.text) {
      baseTurn.interrupt('failed');
      shownFailure = shownFailure || base.failure;
    } else if (base) {
      // No base model to ask (a preset's job, a folder deleted since) or a busy device: said in
      // the turn itself; the checkpoint's answer stands.
      baseTurn.refuse(base.failure ? base.failure.message : 'No answer.');
    } else {
      baseTurn.end('stopped', '(not asked: the checkpoint did not finish)');
      baseTurn.stats.textContent = '';
    }
  });
  // What was shown of an answer, even an incomplete one, stays in the history.
  if (current && answers.isConnected) {
    messages.push({ role: 'assistant', content: turn.text });
    if (compare && baseTurn.text) baseMessages.push({ role: 'assistant', content: baseTurn.text });
    // The base model never answered this message: it is not part of its conversation.
    else if (compare) baseMessages.pop();
  }
  if (current && shownFailure) showError(errorBox, shownFailure);

  streaming = null;
  setStreaming(false);
  // Back to the message box, unless the person has moved on to something else meanwhile.
  const focused = document.activeElement;
  if (!focused || focused === document.body || focused === $('#try-send')) input.focus();
}

$('#try-form').addEventListener('submit', (event) => {
  event.preventDefault();
  send();
});

// Enter sends, Shift+Enter starts a new line (and Enter that confirms a composed character, in
// an input method, does neither).
$('#try-message').addEventListener('keydown', (event) => {
  if (event.key !== 'Enter' || event.shiftKey || event.isComposing || event.keyCode === 229) return;
  event.preventDefault();
  send();
});

$('#try-stop').addEventListener('click', () => {
  if (streaming) streaming.controller.abort();
});

$('#try-new').addEventListener('click', () => {
  newConversation();
  $('#try-message').focus();
});

$('#try-checkpoint').addEventListener('change', () => newConversation());
$('#try-base').addEventListener('change', () => newConversation());

// A job that started from a preset has random weights, not a folder, as its base model.
let baseAvailable = false;
function describeBaseModel() {
  baseAvailable = typeof job.model === 'string' && !job.model.startsWith('preset:');
  const box = $('#try-base');
  box.disabled = !baseAvailable || Boolean(streaming);
  if (!baseAvailable) box.checked = false;
  $('#try-base-hint').textContent = baseAvailable
    ? `The same conversation answered by ${modelLabel(job.model)}, the model this job started from, beside the checkpoint; one model answers at a time.`
    : 'Unavailable: this job started from a preset\'s random weights, so there is no base model to compare with.';
}

// --- answers: the base model's and the tuned one's, record by record ------------------------

let answersData = null;
let answersSeq = 0;

/** Reads the job's answers again (after a task evaluation, or a change of status). */
async function refreshAnswers() {
  if (!job || !job.task) return;
  answersSeq += 1;
  const seq = answersSeq;
  let data = null;
  let failure = null;
  try {
    data = await get(`/api/jobs/${id}/answers`);
  } catch (err) {
    failure = err;
  }
  if (seq !== answersSeq) return;
  const box = $('#answers');
  if (failure) {
    answersData = null;
    box.dataset.state = failure.status === 404 ? 'empty' : 'error';
    const text = failure.status !== 404 ? failure.message
      : job.status === 'queued' || job.status === 'running'
        ? 'The answers appear here once the base model is scored, before the first step.'
        : 'No answers were recorded: the run ended before its first evaluation.';
    fill(box, el('p', { class: 'empty' }, text));
    return;
  }
  answersData = data;
  drawAnswers();
}
const refreshAnswersSoon = debounce(refreshAnswers, 400);

function drawAnswers() {
  if (!answersData) return;
  const box = $('#answers');
  box.dataset.state = typeof answersData.tuned_step === 'number' ? 'tuned' : 'base';
  fill(box, renderAnswers(answersData, $('#answers-order').value));
}

$('#answers-order').addEventListener('change', drawAnswers);

// --- log -------------------------------------------------------------------------------------

function appendLog(lines) {
  const pre = $('#log');
  const atBottom = pre.scrollHeight - pre.scrollTop - pre.clientHeight < 40;
  pre.append(lines.map((l) => `${l}\n`).join(''));
  // Keep the page light on very long runs: drop the oldest text once the log gets long.
  if (pre.textContent.length > MAX_LOG_LINES * 200) {
    const text = pre.textContent;
    pre.textContent = text.slice(text.length - MAX_LOG_LINES * 100);
  }
  if (atBottom) pre.scrollTop = pre.scrollHeight;
}

function logLineOf(data) {
  if (data.startsWith('"')) {
    try {
      return String(JSON.parse(data));
    } catch {
      return data;
    }
  }
  if (data.startsWith('{')) {
    try {
      const obj = JSON.parse(data);
      return String(obj.line ?? obj.message ?? data);
    } catch {
      return data;
    }
  }
  return data;
}

// --- live updates ----------------------------------------------------------------------------

/**
 * The live view: the event stream, then the stored history and log, merged (duplicates merge
 * by step). The history is read only once the stream is open: the server subscribes before it
 * answers, so every point is either stored before the history is read or sent on the stream.
 * Read at the same time as the stream was asked for, the history could come first, and a point
 * stored between the two would be missing for good. Events that arrive while the history is
 * on its way are held and applied after it. A stream that drops and reopens by itself reads
 * the history again, for the points sent while it was away.
 */
function connect() {
  if (source) source.close();
  const stream = new EventSource(`/api/jobs/${id}/events`);
  source = stream;
  let held = { metric: [], log: [] };
  let live = false;
  let firstOpen = true;
  stream.addEventListener('metric', (event) => {
    let point;
    try {
      point = JSON.parse(event.data);
    } catch {
      return;
    }
    if (live) {
      addPoint(point);
      scheduleDraw();
    } else {
      held.metric.push(point);
    }
    // A task evaluation has just written its answers.
    if (point && typeof point.task_score === 'number') refreshAnswersSoon();
  });
  stream.addEventListener('log', (event) => {
    const line = logLineOf(event.data);
    if (live) appendLog([line]);
    else held.log.push(line);
  });
  stream.addEventListener('status', async () => {
    try {
      await refreshJob();
      await refreshCheckpoints();
      refreshAnswersSoon();
      if (TERMINAL.has(job.status)) stream.close();
    } catch (err) {
      showError(error, err);
    }
  });
  stream.onerror = () => {
    // EventSource reconnects by itself; a finished job's stream is not worth reopening.
    if (job && TERMINAL.has(job.status)) stream.close();
  };

  /** Reads the stored history and log, then applies what the stream sent meanwhile. */
  async function catchUp() {
    live = false;
    const [history, log] = await Promise.all([get(`/api/jobs/${id}/metrics`), get(`/api/jobs/${id}/log`).catch(() => '')]);
    if (stream !== source) return;
    for (const point of history || []) addPoint(point);
    for (const point of held.metric) addPoint(point);
    const text = typeof log === 'string' ? log : '';
    fill($('#log'), text.endsWith('\n') || !text ? text : `${text}\n`);
    const tail = text.slice(-4000);
    appendLog(held.log.filter((line) => !tail.includes(line)));
    $('#log').scrollTop = $('#log').scrollHeight;
    held = { metric: [], log: [] };
    live = true;
    scheduleDraw();
  }

  return new Promise((resolve, reject) => {
    stream.addEventListener('open', () => {
      const first = firstOpen;
      firstOpen = false;
      catchUp().then(resolve, (err) => {
        if (first) reject(err);
        else showError(error, err);
      });
    });
    // A stream that fails or is slow to open (the browser holds it back behind other tabs'
    // streams, or the server is down) must not keep the page empty: show the history now; the
    // stream's open, when it comes, reads it again.
    const withoutStream = () => {
      if (!firstOpen) return;
      firstOpen = false;
      catchUp().then(resolve, reject);
    };
    stream.addEventListener('error', withoutStream, { once: true });
    setTimeout(withoutStream, 5000);
  });
}

$('#cancel').addEventListener('click', async () => {
  if (!confirm('Cancel this job? A running job first saves its training state, so Resume can continue exactly where it stopped.')) return;
  try {
    await post(`/api/jobs/${id}/cancel`);
    await refreshJob();
  } catch (err) {
    showError(error, err);
  }
});

$('#delete-job').addEventListener('click', async () => {
  if (!confirm(`Delete this job with its metrics, log and checkpoints? This frees ${fmtBytes(job.disk_bytes || 0)} and cannot be undone.`)) return;
  try {
    const done = await del(`/api/jobs/${id}`);
    if (source) source.close();
    $('#job-body').hidden = true;
    // Nothing of the job is left to show or act on: no status, no "Run again", no buttons.
    for (const button of ['#delete-job', '#cancel', '#resume', '#run-again', '#resume-note']) $(button).hidden = true;
    fill($('#status'));
    $('#subtitle').textContent = '';
    $('#title').textContent = `Job #${id} (deleted)`;
    document.title = `Job #${id} (deleted) · Sluice`;
    fill($('#notice'), `Job #${id} deleted: ${fmtBytes(done.freed_bytes)} freed. `, el('a', { href: '/' }, 'Back to the dashboard'));
    $('#notice').hidden = false;
    job = null;
  } catch (err) {
    showError(error, err);
  }
});

$('#job-name').addEventListener('input', () => { labelEdited = true; });
$('#job-note').addEventListener('input', () => { labelEdited = true; });
$('#label-form').addEventListener('submit', async (event) => {
  event.preventDefault();
  const status = $('#label-status');
  try {
    job = await request('PATCH', `/api/jobs/${id}`, { name: $('#job-name').value, note: $('#job-note').value });
    labelEdited = false;
    renderJob();
    status.textContent = 'Saved.';
  } catch (err) {
    status.textContent = '';
    showError(error, err);
  }
  setTimeout(() => { status.textContent = ''; }, 2500);
});

$('#copy-job-command').addEventListener('click', async () => {
  const copied = await copyText($('#job-command').textContent);
  const note = $('#copy-job-note');
  note.textContent = copied ? 'Copied.' : 'Could not copy: select the text and copy it by hand.';
  setTimeout(() => { note.textContent = ''; }, 2500);
});

for (const [button, method] of [['#demo-on', 'PUT'], ['#demo-off', 'DELETE']]) {
  $(button).addEventListener('click', async () => {
    try {
      const reply = await request(method, `/api/jobs/${id}/demo`);
      job.demo = reply.demo;
      renderDemo();
    } catch (err) {
      showError(error, err);
    }
  });
}

$('#resume').addEventListener('click', async () => {
  try {
    await post(`/api/jobs/${id}/resume`);
    await refreshJob();
    await connect();
  } catch (err) {
    showError(error, err);
  }
});

async function main() {
  try {
    await refreshJob();
  } catch (err) {
    if (err instanceof ApiError && err.status === 404) err.message = 'There is no job here, or it belongs to someone else.';
    showError(error, err);
    return;
  }
  $('#job-body').hidden = false;
  // A job on the processor has no GPU memory and no PCIe link to chart.
  const onGpu = gpuIndices(job.gpu).length > 0;
  const specs = CHARTS.filter((spec) => onGpu || !spec.gpuOnly);
  // The task evaluation's chart comes right after the loss.
  if (job.task) specs.splice(1, 0, taskChart(job.task));
  charts = specs.map((spec) => new MetricChart($('#charts'), spec));
  $('#answers-card').hidden = !job.task;
  if (job.task) refreshAnswers();
  describeBaseModel();
  try {
    await connect();
  } catch (err) {
    showError(error, err);
  }
  await refreshCheckpoints();
  await loadTimeline();
  // Status, queue position and ETA move between events; checkpoints appear as the run saves.
  let tick = 0;
  setInterval(async () => {
    if (!job || TERMINAL.has(job.status)) return;
    tick += 1;
    try {
      const before = job.status;
      await refreshJob();
      if (tick % 3 === 0 || before !== job.status) await refreshCheckpoints();
    } catch {
      // The next tick tries again; a lasting problem shows through the event stream's errors.
    }
  }, 4000);
}

await main();
