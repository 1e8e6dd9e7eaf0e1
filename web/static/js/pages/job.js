// One job: status, progress and ETA; its settings, placement, disk use and equivalent command;
// live charts fed by server-sent events on top of the stored history (so a reload loses
// nothing); the log; checkpoints to download or try; cancel and resume (which continues from the
// saved training state exactly).
import { ApiError, get, post, requireUser } from '../api.js';
import { MetricChart } from '../charts.js';
import { renderTimeline } from '../timeline.js';
import { $, copyText, el, fill, fmtBytes, fmtDate, fmtDuration, fmtInt, fmtNum, idFromPath, showError, statusBadge } from '../ui.js';
import { canResume, deviceLabel, jobProgress, modelLabel, placeInLine, queuePosition, settingsList } from './job_fields.js';

const me = await requireUser();
const id = idFromPath();
const error = $('#error');
const TERMINAL = new Set(['completed', 'failed', 'cancelled', 'interrupted']);
const MAX_LOG_LINES = 3000;

const gbps = (v) => `${fmtNum(v)} GB/s`;
const CHARTS = [
  { key: 'loss', title: 'Loss', series: [{ field: 'loss', label: 'train' }, { field: 'eval_loss', label: 'eval', sparse: true }], format: fmtNum },
  { key: 'lr', title: 'Learning rate', series: [{ field: 'lr', label: 'lr' }], format: fmtNum },
  { key: 'grad_norm', title: 'Gradient norm', series: [{ field: 'grad_norm', label: 'norm' }], format: fmtNum },
  { key: 'tokens_per_s', title: 'Tokens per second', series: [{ field: 'tokens_per_s', label: 'tokens/s' }], format: fmtNum },
  { key: 'tflops', title: 'TFLOPS', series: [{ field: 'tflops', label: 'TFLOPS' }], format: fmtNum },
  { key: 'gpu_mem', title: 'GPU memory', series: [{ field: 'gpu_mem', label: 'in use' }], format: fmtBytes },
  { key: 'pcie', title: 'PCIe transfer', series: [{ field: 'h2d_gbps', label: 'host → GPU' }, { field: 'd2h_gbps', label: 'GPU → host' }], format: gbps },
  { key: 'host_mem', title: 'Host memory', series: [{ field: 'host_mem', label: 'in use' }], format: fmtBytes },
  { key: 'optimizer_s', title: 'Optimizer time per step', series: [{ field: 'optimizer_s', label: 'seconds' }], format: fmtDuration },
];

let job = null;
let source = null;
const points = new Map(); // step -> merged point
let sorted = [];
let charts = [];
let drawQueued = false;

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
    const withTimeline = [...sorted].reverse().find((p) => p.timeline);
    if (withTimeline) renderTimeline($('#timeline'), withTimeline.timeline, withTimeline.step);
    renderSummary();
  });
}

// --- job header and summary ------------------------------------------------------------------

function fact(label, value, key) {
  return el('div', { class: 'fact', dataset: { fact: key } }, el('div', { class: 'k' }, label), el('div', { class: 'v' }, value));
}

function renderJob() {
  if (!job) return;
  document.title = `Job ${id} · Sluice`;
  $('#title').textContent = `Job #${id}`;
  fill($('#status'), statusBadge(job.status));
  $('#subtitle').textContent = [modelLabel(job.model), job.dataset_name, deviceLabel(job.gpu), me.role === 'admin' && job.owner ? `owner ${job.owner}` : null, `created ${fmtDate(job.created_at)}`]
    .filter(Boolean).join(' · ');
  $('#cancel').hidden = !(job.status === 'queued' || job.status === 'running');
  $('#resume').hidden = !canResume(job);
  const failure = $('#job-failure');
  if (job.error && (job.status === 'failed' || job.status === 'interrupted')) {
    failure.textContent = job.error;
    failure.hidden = false;
  } else {
    failure.hidden = true;
  }
  renderSettings();
  renderSummary();
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
  } else if (typeof config.eval_every === 'number' && typeof config.held_out === 'number') {
    evaluation = `${Number((config.held_out * 100).toPrecision(3))}% of ${job.dataset_name || 'the training data'}, held out`;
  }
  $('#job-eval-text').textContent = evaluation;
  $('#job-eval').hidden = !evaluation;

  // The held-out share matters only to a job that evaluates without a dataset of its own.
  const heldOut = typeof config.eval_every === 'number' && (job.eval_dataset === null || job.eval_dataset === undefined);
  const rows = settingsList(config).filter((row) => row.key !== 'held_out' || heldOut);
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
    fact('Eval loss', evalPoint ? fmtNum(evalPoint.eval_loss) : '—', 'eval_loss'),
    fact('Speed', speed, 'speed'),
    fact('Disk used', fmtBytes(job.disk_bytes), 'disk'),
    fact('Points', fmtInt(sorted.length), 'points'));
}

async function refreshJob() {
  job = await get(`/api/jobs/${id}`);
  renderJob();
  return job;
}

// --- checkpoints -----------------------------------------------------------------------------

function fileUrl(checkpoint, file) {
  return `/api/jobs/${id}/checkpoints/${encodeURIComponent(checkpoint.name)}/files/${encodeURIComponent(file.name)}`;
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
        el('a', { class: 'btn small', href: `/api/jobs/${id}/checkpoints/${encodeURIComponent(c.name)}/archive`, download: `job-${id}-${c.name}.tar`, dataset: { archive: c.name } }, 'Download all (.tar)')),
      el('details', {}, el('summary', { class: 'small muted' }, `${(c.files || []).length} files`),
        el('ul', { class: 'files' }, (c.files || []).map((f) => el('li', {},
          el('a', { href: fileUrl(c, f), download: f.name }, f.name), el('span', { class: 'muted num' }, fmtBytes(f.size)))))));
  }));
}

// --- try a checkpoint ------------------------------------------------------------------------

// The list is rebuilt only when the checkpoints change, so a choice (and the typed prompt, which
// lives outside the list) survive the periodic refresh.
function renderTryChoices(checkpoints) {
  const select = $('#try-checkpoint');
  const names = checkpoints.map((c) => c.name);
  const current = [...select.options].map((o) => o.value);
  $('#try').hidden = names.length === 0;
  if (names.join('\n') === current.join('\n')) return;
  const chosen = select.value;
  fill(select, names.map((n) => el('option', { value: n }, n)));
  if (names.includes(chosen)) select.value = chosen;
}

$('#try-form').addEventListener('submit', async (event) => {
  event.preventDefault();
  const name = $('#try-checkpoint').value;
  const prompt = $('#try-prompt').value;
  if (!name || !prompt.trim()) return;
  const button = $('#try-button');
  const answer = $('#try-answer');
  showError($('#try-error'), null);
  button.disabled = true;
  answer.hidden = false;
  answer.textContent = 'Generating…';
  try {
    const reply = await post(`/api/jobs/${id}/checkpoints/${encodeURIComponent(name)}/generate`, {
      prompt,
      max_new_tokens: Number($('#try-tokens').value) || 64,
      temperature: Number($('#try-temperature').value) || 0,
    });
    answer.textContent = reply.text || '(the model ended at once, with no text)';
  } catch (err) {
    answer.hidden = true;
    showError($('#try-error'), err);
  } finally {
    button.disabled = false;
  }
});

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
 * Opens the event stream first and holds its events until the stored history and log are in,
 * so that nothing produced between the two requests is lost; duplicates merge by step.
 */
async function connect() {
  if (source) source.close();
  const held = { metric: [], log: [] };
  let live = false;
  source = new EventSource(`/api/jobs/${id}/events`);
  source.addEventListener('metric', (event) => {
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
  });
  source.addEventListener('log', (event) => {
    const line = logLineOf(event.data);
    if (live) appendLog([line]);
    else held.log.push(line);
  });
  source.addEventListener('status', async () => {
    try {
      await refreshJob();
      await refreshCheckpoints();
      if (TERMINAL.has(job.status)) source.close();
    } catch (err) {
      showError(error, err);
    }
  });
  source.onerror = () => {
    // EventSource reconnects by itself; a finished job's stream is not worth reopening.
    if (job && TERMINAL.has(job.status)) source.close();
  };

  const [history, log] = await Promise.all([get(`/api/jobs/${id}/metrics`), get(`/api/jobs/${id}/log`).catch(() => '')]);
  for (const point of history || []) addPoint(point);
  for (const point of held.metric) addPoint(point);
  const text = typeof log === 'string' ? log : '';
  fill($('#log'), text.endsWith('\n') || !text ? text : `${text}\n`);
  const tail = text.slice(-4000);
  appendLog(held.log.filter((line) => !tail.includes(line)));
  $('#log').scrollTop = $('#log').scrollHeight;
  live = true;
  scheduleDraw();
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

$('#copy-job-command').addEventListener('click', async () => {
  const copied = await copyText($('#job-command').textContent);
  const note = $('#copy-job-note');
  note.textContent = copied ? 'Copied.' : 'Could not copy: select the text and copy it by hand.';
  setTimeout(() => { note.textContent = ''; }, 2500);
});

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
  charts = CHARTS.map((spec) => new MetricChart($('#charts'), spec));
  try {
    await connect();
  } catch (err) {
    showError(error, err);
  }
  await refreshCheckpoints();
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
