// New job: model, dataset, device, settings with presets, the evaluation (which records, which
// metric, with a sample of what it will compare), and the planner's verdict fetched live as
// anything changes. The plan is asked with exactly the body the job would be submitted with,
// so its verdict, placement and equivalent command are those of this job. Submitting is refused
// (with the reason) when the plan does not fit.
import { get, post, requireUser } from '../api.js';
import { $, bar, copyText, debounce, el, fill, fmtBytes, fmtCount, fmtDuration, fmtInt, showError } from '../ui.js';
import { ANSWER_FORMATS, METRICS, gpuIndices } from './job_fields.js';

const me = await requireUser();

// Every setting with its default, bounds and choices, the learning rates a job takes without
// one and those worth a warning, as the engine states them under this appliance's limits: the
// form copies none.
const guide = await get('/api/job-defaults');
const SETTINGS = Object.fromEntries(guide.settings.map((s) => [s.name, s]));
const LR = { preset: guide.lr_random_init, local: guide.lr_pretrained };
const LR_BANDS = Array.isArray(guide.lr_bands) ? guide.lr_bands : [];

// Settings a newcomer can start from. `lr` depends on the model: random-init presets learn
// fast with a large rate; pretrained weights need a small one not to forget what they know.
// An empty string leaves the field empty, so the engine's default applies.
const PRESETS = {
  demo: {
    hint: 'A short run to see training work: about a minute for the tiny preset, even on the processor.',
    values: { steps: 20, seq_len: 128, micro_batch: 4, grad_accum: 1, schedule: 'cosine', warmup: 2, weight_decay: 0, max_grad_norm: 1, gradients: 'auto', moments: 'auto', save_every: '', seed: 0, eval_every: '', save_dtype: 'bf16' },
  },
  finetune: {
    hint: 'A real fine-tune: longer sequences, 8 micro-batches per step, a checkpoint and an evaluation every 100 steps.',
    values: { steps: 500, seq_len: 1024, micro_batch: 1, grad_accum: 8, schedule: 'cosine', warmup: 20, weight_decay: 0, max_grad_norm: 1, gradients: 'auto', moments: 'auto', save_every: 100, seed: 0, eval_every: 100, save_dtype: 'bf16' },
  },
};
// Changing one of these makes the settings "Custom"; the others (which data to evaluate on,
// whether prompts are trained) belong to the data, not to a preset.
const PRESET_FIELDS = new Set([...Object.keys(PRESETS.demo.values), 'lr']);
// The engine's settings by kind: a choice has words, a switch is off by default, the rest are
// numbers (sent as numbers, and left out when empty so that the engine's default applies).
// Only those the form has a field for are offered.
const shown = guide.settings.filter((s) => document.getElementById(s.name));
const CHOICE_FIELDS = shown.filter((s) => s.choices.length).map((s) => s.name);
const SWITCH_FIELDS = shown.filter((s) => s.default === false).map((s) => s.name);
// Free text (the answer pattern): sent as written, left out when empty.
const TEXT_FIELDS = shown.filter((s) => s.text).map((s) => s.name);
const NUMBER_FIELDS = shown.map((s) => s.name)
  .filter((n) => !CHOICE_FIELDS.includes(n) && !SWITCH_FIELDS.includes(n) && !TEXT_FIELDS.includes(n));
const ALL_FIELDS = [...NUMBER_FIELDS, ...CHOICE_FIELDS, ...TEXT_FIELDS, 'eval_dataset', ...SWITCH_FIELDS];
// The choices the engine offers for the evaluation, named and explained by the page, each
// select starting at the engine's default.
for (const [id, words] of [['eval_metric', METRICS], ['eval_answer', ANSWER_FORMATS]]) {
  const s = SETTINGS[id];
  if (!s || !document.getElementById(id)) continue;
  fill($(`#${id}`), s.choices.map((c) => el('option', { value: c }, words[c] ? words[c].label : c)));
  if (s.default !== null) $(`#${id}`).value = String(s.default);
}
// The bounds the engine holds each number to, so the browser flags a value before the server
// does; a default is the placeholder where the field has none of its own ("one pass", "never").
for (const id of NUMBER_FIELDS) {
  const input = $(`#${id}`);
  const s = SETTINGS[id];
  if (s.min !== null && s.min !== undefined) input.min = String(s.min);
  if (s.max !== null && s.max !== undefined) input.max = String(s.max);
  if (!input.placeholder && s.default !== null) input.placeholder = String(s.default);
}
const TIER_LABELS = {
  device: 'GPU memory',
  gpu: 'GPU memory',
  'pinned host': 'Pinned host memory',
  'pageable host': 'Host memory (RAM)',
  host: 'Host memory (RAM)',
  'disk tier': 'Disk tier (SSD)',
};
const BOTTLENECKS = { pcie: 'PCIe copies', gpu_compute: 'GPU compute', cpu_adam: 'CPU optimizer', disk: 'the disk tier', compute: 'compute', cpu: 'the processor' };
// The settings a plan's suggestion may change, as the form names them.
const SUGGESTED = { micro_batch: (n) => `micro-batch ${n}`, grad_accum: (n) => `${n} micro-batch${n === 1 ? '' : 'es'} per step` };
const PART_COLORS = ['#4c8be0', '#36a87a', '#d08a2e', '#9a6bd1', '#d05a7a', '#3fb0c0', '#8a8f3a', '#7a7f8c'];

let models = [];
let datasets = [];
let preset = 'demo';
let plan = null;
let planError = null;
let commandOpen = false;
// Whether the plan card's engineering details (placement, bottleneck, the gradient policies
// in bytes per parameter) are unfolded; kept across the card's redraws.
let detailsOpen = false;

const params = new URLSearchParams(location.search);
const card = $('#plan-card');

function selectedModel() {
  return models.find((m) => m.id === $('#model').value);
}

function selectedGpu() {
  const checked = document.querySelector('input[name="gpu"]:checked');
  return checked ? checked.value : null;
}

/** Whether the job would run on a GPU (else on the processor, in host memory). */
function onGpu() {
  return gpuIndices(selectedGpu()).length > 0;
}

/** How the card names a memory tier: on the processor the "device" is host memory. */
function tierLabel(name) {
  if (!onGpu() && (name === 'device' || name === 'gpu')) return 'Memory (RAM)';
  return TIER_LABELS[name] || name;
}

function setPreset(name) {
  preset = name;
  for (const button of document.querySelectorAll('#presets button')) {
    button.setAttribute('aria-pressed', String(button.dataset.preset === name));
  }
  const p = PRESETS[name];
  $('#preset-hint').textContent = p ? p.hint : 'Your own settings.';
}

function applyPreset(name) {
  setPreset(name);
  const p = PRESETS[name];
  if (!p) return;
  for (const [key, value] of Object.entries(p.values)) $(`#${key}`).value = String(value);
  const model = selectedModel();
  $('#lr').value = LR[model && model.kind === 'local' ? 'local' : 'preset'];
  warnLr();
}

function describeModel() {
  const m = selectedModel();
  $('#model-hint').textContent = m ? [m.family, m.kind === 'preset' ? 'preset, starts from random weights' : 'local folder', m.note].filter(Boolean).join(' · ') : '';
  const random = !m || m.kind === 'preset';
  const lr = random ? LR.preset : LR.local;
  $('#lr-hint').textContent = `how far each step moves the model; empty: ${lr} ${random ? '(random weights learn fast)' : '(keeps what the model knows)'}`;
  $('#lr').placeholder = String(lr);
  warnLr();
}

/**
 * The engine's band for this model: random weights take far larger rates than trained ones,
 * and larger models smaller ones (`lr_bands` of the settings guide; the first that matches).
 */
function lrBand() {
  const m = selectedModel();
  const method = !m || m.kind === 'preset' ? 'random_init' : 'pretrained';
  const params = m && typeof m.params === 'number' ? m.params : 0;
  return LR_BANDS.find((b) => b.method === method && (b.max_params === null || params <= b.max_params)) || null;
}

/** A learning rate above the band runs, but likely throws the loss up: say so under the field. */
function warnLr() {
  const box = $('#lr-warning');
  const raw = $('#lr').value.trim();
  const lr = Number(raw);
  const band = lrBand();
  const high = raw !== '' && Number.isFinite(lr) && band && lr > band.warn_above && $('#lr').validity.valid;
  box.hidden = !high;
  box.textContent = high
    ? `Learning rate ${raw} is high for ${band.method === 'random_init' ? 'random weights' : 'a trained model'} of this size: above ${band.warn_above} the loss often climbs instead of falling${band.method === 'pretrained' ? ' and the model forgets what it knew' : ''}.`
    : '';
}

/** The held-out share applies only when no evaluation dataset is chosen. */
/** With clipping off (0) gradients wait nowhere: there is no choice of where. */
function syncGradientField() {
  const raw = $('#max_grad_norm').value.trim();
  const off = raw !== '' && Number(raw) === 0;
  $('#gradients').disabled = off;
  if (off) $('#gradients').value = 'auto';
}

/**
 * The evaluation's fields that apply: the held-out share without an evaluation dataset, the
 * answer format with `extract`, its pattern with `regex`; each metric and format explained.
 * Fields that do not apply are hidden and disabled, so they are not sent.
 */
function syncEvalFields() {
  const training = $('#dataset').value;
  const evalSelect = $('#eval_dataset');
  for (const option of evalSelect.options) option.disabled = option.value !== '' && option.value === training;
  if (evalSelect.value !== '' && evalSelect.value === training) evalSelect.value = '';
  const separate = evalSelect.value !== '';
  $('#held_out').disabled = separate;
  $('#held_out-field').hidden = separate;
  const metric = $('#eval_metric').value;
  const extract = metric === 'extract';
  const regex = extract && $('#eval_answer').value === 'regex';
  $('#eval_answer').disabled = !extract;
  $('#eval_answer-field').hidden = !extract;
  $('#eval_pattern').disabled = !regex;
  $('#eval_pattern-field').hidden = !regex;
  $('#eval_metric-hint').textContent = METRICS[metric] ? METRICS[metric].help : '';
  const format = ANSWER_FORMATS[$('#eval_answer').value];
  $('#eval_answer-hint').textContent = format ? format.help : '';
}

// --- a sample of what the evaluation will compare -------------------------------------------

// The eval set does not suit the metric (the server's 422): the job would fail before its
// first step, so the form does not start it.
let sampleError = null;
let lastSample = null;
let sampleSeq = 0;

/** The first records of the eval set as the job's evaluation will ask and compare them. */
async function refreshSample() {
  sampleSeq += 1;
  const seq = sampleSeq;
  const box = $('#eval-sample');
  const metric = $('#eval_metric').value;
  const evalId = $('#eval_dataset').value;
  const trainId = $('#dataset').value;
  if (!metric || metric === 'loss' || !(evalId || trainId)) {
    sampleError = null;
    lastSample = null;
    showInvalid();
    box.hidden = true;
    box.dataset.state = 'off';
    fill(box);
    return;
  }
  const query = new URLSearchParams({ eval_metric: metric });
  if (!evalId) query.set('held_out', $('#held_out').value.trim() || String(SETTINGS.held_out.default));
  box.hidden = false;
  box.dataset.state = 'pending';
  try {
    const sample = await get(`/api/datasets/${encodeURIComponent(evalId || trainId)}/eval-sample?${query}`);
    if (seq !== sampleSeq) return;
    sampleError = null;
    lastSample = sample;
    renderSample();
    box.dataset.state = 'ready';
  } catch (err) {
    if (seq !== sampleSeq) return;
    lastSample = null;
    sampleError = err.status === 422 || err.status === 400 ? err : null;
    fill(box, el('div', { class: 'alert error', id: 'eval-sample-error' }, labelled(err).message));
    box.dataset.state = 'error';
  }
  showInvalid();
}
const refreshSampleSoon = debounce(refreshSample, 300);

function sampleChanged() {
  $('#eval-sample').dataset.state = 'pending';
  refreshSampleSoon();
}

function renderSample() {
  const sample = lastSample;
  if (!sample) return;
  const items = Array.isArray(sample.items) ? sample.items : [];
  const limit = Number($('#eval_records').value.trim() || SETTINGS.eval_records.default);
  const scored = Math.min(sample.records, Number.isFinite(limit) && limit > 0 ? limit : sample.records);
  const perplexity = sample.metric === 'perplexity';
  const choice = sample.metric === 'choice';
  fill($('#eval-sample'),
    el('p', { class: 'small', style: { margin: 0 } }, el('strong', {}, 'A sample of what will be compared'),
      ` · the first ${fmtInt(items.length)} of ${fmtInt(sample.records)} ${sample.records === 1 ? 'record' : 'records'}`,
      scored < sample.records ? `; each evaluation answers the first ${fmtInt(scored)}` : ''),
    el('ol', {}, items.map((item) => el('li', { dataset: { line: String(item.line) } },
      el('div', {}, el('span', { class: 'k' }, choice ? 'Question' : 'Prompt'), el('span', { class: 'text prompt' }, item.prompt)),
      choice && Array.isArray(item.choices) && item.choices.length
        ? el('div', {}, el('span', { class: 'k' }, 'Choices'),
          el('ul', { class: 'choices' }, item.choices.map((c) => el('li', { class: c === item.reference ? 'right' : null },
            c, c === item.reference ? el('span', { class: 'muted' }, ' (right)') : null))))
        : el('div', {}, el('span', { class: 'k' }, perplexity ? 'Scored text' : 'Reference'), el('span', { class: 'text reference' }, item.reference)),
      el('div', { class: 'small muted' }, `line ${fmtInt(item.line)}`)))));
}

/**
 * The body of `POST /api/plan` and `POST /api/jobs` alike: numbers as numbers, empty fields
 * left out. Disabled fields (the held-out share beside an evaluation dataset) are not sent.
 */
function jobBody() {
  const body = { model: $('#model').value, gpu: selectedGpu() };
  if ($('#dataset').value) body.dataset = Number($('#dataset').value);
  if ($('#eval_dataset').value) body.eval_dataset = Number($('#eval_dataset').value);
  for (const id of NUMBER_FIELDS) {
    const input = $(`#${id}`);
    const raw = input.value.trim();
    if (!input.disabled && raw !== '') body[id] = Number(raw);
  }
  for (const id of CHOICE_FIELDS) if (!$(`#${id}`).disabled) body[id] = $(`#${id}`).value;
  for (const id of TEXT_FIELDS) {
    const input = $(`#${id}`);
    if (!input.disabled && input.value !== '') body[id] = input.value;
  }
  body.train_on_prompt = $('#train_on_prompt').checked;
  // The name and note are the job's, not the plan's; the server ignores them in a plan.
  for (const id of ['name', 'note']) {
    const text = $(`#${id}`).value.trim();
    if (text) body[id] = text;
  }
  return body;
}

/**
 * "Run again with these settings": the form takes job `from`'s model, data, device and every
 * setting it ran with; the person can change any of them before starting.
 */
async function prefillFrom(from) {
  const job = await get(`/api/jobs/${encodeURIComponent(from)}`);
  const config = job.config && typeof job.config === 'object' ? job.config : {};
  if (models.some((m) => m.id === job.model)) $('#model').value = job.model;
  describeModel();
  if (datasets.some((d) => d.id === job.dataset)) $('#dataset').value = String(job.dataset);
  $('#eval_dataset').value = datasets.some((d) => d.id === job.eval_dataset) ? String(job.eval_dataset) : '';
  const radio = document.querySelector(`input[name="gpu"][value="${CSS.escape(job.gpu || '')}"]`);
  if (radio) radio.checked = true;
  describeDevice();
  for (const id of [...NUMBER_FIELDS, ...CHOICE_FIELDS, ...TEXT_FIELDS]) {
    const value = config[id];
    // f32 settings arrive widened (1e-3 as 0.0010000000474974513): six digits say it all.
    const input = $(`#${id}`);
    input.value = typeof value === 'number' ? String(Number(value.toPrecision(6))) : value ?? '';
    // A job from before a choice existed ran with its first option (the default).
    if (input.tagName === 'SELECT' && input.selectedIndex < 0) input.selectedIndex = 0;
  }
  syncGradientField();
  warnLr();
  $('#train_on_prompt').checked = Boolean(config.train_on_prompt);
  const name = job.name || `Job #${job.id}`;
  $('#name').value = `${name} (again)`.slice(0, 100);
  $('#note').value = job.note || '';
  setPreset('custom');
  syncEvalFields();
  $('#preset-hint').textContent = `The settings of ${name}; change any of them before starting.`;
}

function fieldLabel(id) {
  const label = document.querySelector(`label[for="${id}"]`);
  return label ? label.textContent.trim() : id;
}

/** The browser's own check of the number fields (a letter typed, a value under `min`). */
function invalidFields() {
  return NUMBER_FIELDS.map((id) => $(`#${id}`)).filter((input) => !input.disabled && !input.validity.valid);
}

// The fields the plan's answer and the evaluation sample's call wrong.
let planInvalid = [];

/** Marks the field a message is about: the server's messages start with the field's name. */
function markInvalid(ids) {
  planInvalid = ids;
  showInvalid();
}

function showInvalid() {
  const ids = [...planInvalid, ...(sampleError ? fieldOf(sampleError.message) : [])];
  for (const id of ALL_FIELDS) {
    const input = $(`#${id}`);
    if (ids.includes(id)) input.setAttribute('aria-invalid', 'true');
    else input.removeAttribute('aria-invalid');
  }
  // A problem inside the folded section must not stay out of sight.
  if (planInvalid.some((id) => $('#advanced').contains($(`#${id}`)))) $('#advanced').open = true;
}

function fieldOf(message) {
  const match = /^([a-z_]+)\b/.exec(message || '');
  return match && ALL_FIELDS.includes(match[1]) ? [match[1]] : [];
}

/** The server names a field as the engine does (`lr must be…`); the form says its label. */
function labelled(err) {
  const [id] = fieldOf(err && err.message);
  if (!id) return err;
  const out = new Error(`${fieldLabel(id)}${err.message.slice(id.length)}`);
  out.status = err.status;
  return out;
}

/** The message for a number field the browser finds out of bounds, in the engine's words. */
function boundsMessage(input) {
  const s = SETTINGS[input.id] || {};
  const label = fieldLabel(input.id);
  if (input.validity.badInput || input.validity.stepMismatch) return `${label} must be a number.`;
  const low = s.min === null || s.min === undefined ? null : `${s.above ? 'above' : 'at least'} ${s.min}`;
  const high = s.max === null || s.max === undefined ? null : `at most ${s.max}`;
  const bounds = [low, high].filter(Boolean).join(' and ');
  return bounds ? `${label} must be ${bounds}, got ${input.value}.` : `${label}: ${input.validationMessage}`;
}

/** A predicted duration: "≈ 1.2 s", "< 1 ms", or "—" when there is none. */
function about(seconds) {
  if (typeof seconds !== 'number' || !Number.isFinite(seconds)) return '—';
  return seconds < 0.0005 ? '< 1 ms' : `≈ ${fmtDuration(seconds)}`;
}

/**
 * Sizes in the plan card as the plan's sentence writes them (the server's `jobs::plan::gib`):
 * GiB with one decimal, MiB below one GiB; binary units, labelled as such.
 */
function planBytes(bytes) {
  if (typeof bytes !== 'number' || !Number.isFinite(bytes)) return '—';
  const gib = 2 ** 30;
  return bytes >= gib ? `${(bytes / gib).toFixed(1)} GiB` : `${(bytes / 2 ** 20).toFixed(1)} MiB`;
}

function fact(label, value, key) {
  return el('div', { class: 'fact', dataset: { plan: key } }, el('div', { class: 'k' }, label), el('div', { class: 'v' }, value));
}

function renderTier(tier) {
  const capacity = tier.capacity;
  const parts = (tier.parts || []).filter((p) => p.bytes > 0);
  const used = typeof tier.used === 'number' ? tier.used : parts.reduce((sum, p) => sum + p.bytes, 0);
  const over = capacity > 0 && used > capacity;
  const scale = capacity > 0 ? Math.max(capacity, used) : Math.max(used, 1);
  const segments = parts.map((p, i) => el('span', {
    title: `${p.name}: ${planBytes(p.bytes)}`,
    style: { width: `${(100 * p.bytes) / scale}%`, background: PART_COLORS[i % PART_COLORS.length] },
  }));
  const barNode = parts.length ? el('div', { class: 'bar tall' }, segments) : bar(capacity > 0 ? used / capacity : 0, { tall: true });
  return el('div', { class: 'tier', dataset: { tier: tier.name } },
    el('div', { class: 'tier-head' },
      el('strong', {}, tierLabel(tier.name)),
      el('span', { class: over ? 'num' : 'num muted', style: over ? { color: 'var(--danger)', fontWeight: 600 } : {} },
        capacity > 0 ? `${planBytes(used)} of ${planBytes(capacity)}${over ? ' — too much' : ''}` : planBytes(used))),
    barNode,
    parts.length ? el('div', { class: 'legend' }, parts.map((p, i) => el('span', {},
      el('i', { style: { background: PART_COLORS[i % PART_COLORS.length] } }), `${p.name} ${planBytes(p.bytes)}`))) : null);
}

// How the plan card names each gradient policy (the job's `gradients` value, or clipping off);
// on the processor the device's memory is host memory too.
const GRADIENT_LABELS = {
  device: 'On the GPU (fp32)',
  host: 'In host memory (fp32)',
  host_bf16: 'In host memory (bf16)',
  no_clip: 'No clipping',
};
const CPU_GRADIENT_LABELS = { device: 'Beside the weights (fp32)', host: 'In a separate store (fp32)' };

function gradientLabel(policy) {
  return (!onGpu() && CPU_GRADIENT_LABELS[policy]) || GRADIENT_LABELS[policy] || policy;
}

/**
 * Each gradient policy with what it needs and does; a button switches the form to another one
 * that fits (clipping off for "No clipping").
 */
function renderGradientOptions(options) {
  if (!Array.isArray(options) || !options.length) return null;
  const use = (option) => {
    if (option.policy === 'no_clip') {
      $('#max_grad_norm').value = '0';
    } else {
      if (Number($('#max_grad_norm').value.trim() || '1') === 0) $('#max_grad_norm').value = '1';
      $('#gradients').value = option.policy;
    }
    syncGradientField();
    setPreset('custom');
    planChanged();
  };
  const rows = options.map((o) => el('tr', { dataset: { policy: o.policy, fits: String(o.fits), chosen: String(o.chosen) } },
    el('td', {}, el('strong', {}, gradientLabel(o.policy)), o.chosen ? el('span', { class: 'badge fits', style: { marginLeft: '.4rem' } }, 'this job') : null),
    el('td', { class: 'num' }, o.fits ? `${planBytes(o.host_bytes)} (${o.host_bytes_per_param.toFixed(1)} B/param)${o.disk_bytes > 0 ? ` + ${planBytes(o.disk_bytes)} on disk` : ''}` : '—'),
    el('td', { class: 'num' }, o.fits ? about(o.step_s) : 'does not fit'),
    el('td', { class: 'muted' }, o.fits ? o.effect : `${o.effect}. ${o.refused || ''}`),
    el('td', {}, o.fits && !o.chosen ? el('button', { type: 'button', class: 'small', onclick: () => use(o) }, 'Use') : null)));
  return el('div', { id: 'plan-gradients' },
    el('h3', { style: { marginTop: '1rem' } }, 'Where gradients wait'),
    el('div', { class: 'table-scroll' }, el('table', { class: 'list' },
      el('thead', {}, el('tr', {}, ['Policy', 'Host memory', 'Step', 'Effect on training', ''].map((h) => el('th', {}, h)))),
      el('tbody', {}, rows))));
}

function renderCommand() {
  const command = plan && typeof plan.command === 'string' ? plan.command : '';
  const button = $('#show-command');
  button.disabled = !command;
  button.setAttribute('aria-expanded', String(commandOpen && Boolean(command)));
  button.textContent = commandOpen ? 'Hide the equivalent command' : 'Show the equivalent command';
  $('#command').textContent = command;
  $('#command-box').hidden = !(commandOpen && command);
}

function renderPlan() {
  const box = $('#plan');
  const verdict = $('#plan-verdict');
  const submit = $('#submit');
  const note = $('#submit-note');
  renderCommand();
  if (planError) {
    fill(verdict);
    fill(box, el('div', { class: 'alert error', id: 'plan-error' }, planError.message));
    submit.disabled = false;
    note.textContent = '';
    return;
  }
  if (!plan) return;
  const body = jobBody();
  fill(verdict, el('span', { class: `badge ${plan.fits ? 'fits' : 'nofit'}`, id: 'plan-fits', dataset: { fits: String(plan.fits) } },
    plan.fits ? 'Fits' : 'Does not fit'));
  // An empty field means the engine's default.
  const size = (key) => body[key] ?? SETTINGS[key].default;
  // grad_accum counts the micro-batches of a whole step, over every GPU of a data-parallel job.
  const tokensPerStep = size('seq_len') * size('micro_batch') * size('grad_accum');
  // The server words the whole run's time as the sentence does ("about 7 days").
  const total = typeof plan.run_time === 'string' ? plan.run_time : body.steps ? '—' : 'one pass over the data';
  const change = plan.suggestion && SUGGESTED[plan.suggestion.field] ? plan.suggestion : null;
  // What a newcomer needs stays in sight: the verdict, the time and the memory bars. How the
  // planner places the state and the gradient policies in bytes per parameter fold away.
  const details = el('details', { id: 'plan-details', open: detailsOpen },
    el('summary', {}, 'Details'),
    typeof plan.placement === 'string' && plan.placement
      ? el('p', { class: 'placement', id: 'plan-placement' }, el('span', { class: 'k' }, 'Placement'), plan.placement)
      : null,
    // Where the Adam moments live when some are on the disk tier, and what that costs a step.
    typeof plan.disk === 'string' && plan.disk
      ? el('p', { class: 'placement', id: 'plan-disk' }, el('span', { class: 'k' }, 'Disk tier'), plan.disk)
      : null,
    el('div', { class: 'facts' },
      fact('Bottleneck', BOTTLENECKS[plan.bottleneck] || plan.bottleneck || '—', 'bottleneck'),
      fact('Tokens / step', fmtInt(tokensPerStep), 'tokens')),
    renderGradientOptions(plan.gradient_options));
  details.addEventListener('toggle', () => { detailsOpen = details.open; });
  fill(box,
    plan.reason ? el('p', { id: 'plan-reason' }, plan.reason) : null,
    change ? el('p', {}, el('button', {
      type: 'button',
      class: 'small',
      id: 'plan-apply',
      onclick: () => {
        $(`#${change.field}`).value = String(change.value);
        setPreset('custom');
        planChanged();
      },
    }, `Use ${SUGGESTED[change.field](change.value)}`)) : null,
    el('div', { class: 'facts' },
      fact('Step time', about(plan.step_time_s), 'step_time'),
      typeof plan.eval_time_s === 'number' ? fact('Each evaluation', `≤ ${fmtDuration(plan.eval_time_s)}`, 'eval_time') : null,
      fact('Whole run', total, 'total_time')),
    // The task evaluation's cost in words: records, forwards, the device memory kept for it.
    typeof plan.eval === 'string' && plan.eval ? el('p', { class: 'placement', id: 'plan-eval' }, plan.eval) : null,
    el('h3', { style: { marginTop: '1rem' } }, 'Memory'),
    (plan.tiers || []).map(renderTier),
    details);
  submit.disabled = !plan.fits;
  note.textContent = plan.fits ? '' : `Cannot start. ${plan.reason || 'The job does not fit this device.'}`;
}

// `data-state` on the card says whether what it shows answers the form as it is now ("ready")
// or a newer plan is on its way ("pending"); the browser test waits on it.
let planSeq = 0;
async function refreshPlan() {
  const seq = planSeq;
  const body = jobBody();
  const invalid = invalidFields();
  if (invalid.length) {
    plan = null;
    planError = new Error(invalid.map(boundsMessage).join(' '));
    markInvalid(invalid.map((input) => input.id));
    card.classList.remove('loading');
    renderPlan();
    card.dataset.state = 'ready';
    return;
  }
  if (!body.model || !body.gpu) return;
  card.classList.add('loading');
  try {
    const result = await post('/api/plan', body);
    if (seq !== planSeq) return;
    plan = result;
    planError = null;
    markInvalid([]);
  } catch (err) {
    if (seq !== planSeq) return;
    plan = null;
    planError = labelled(err);
    markInvalid(err.status === 400 ? fieldOf(err.message) : []);
  }
  card.classList.remove('loading');
  renderPlan();
  card.dataset.state = 'ready';
}
const refreshPlanSoon = debounce(refreshPlan, 250);

/** Something the plan depends on changed: what the card shows is stale until the next answer. */
function planChanged() {
  planSeq += 1;
  card.dataset.state = 'pending';
  refreshPlanSoon();
}

/** With several GPUs, a step's micro-batches are shared out among them. */
function describeDevice() {
  const gpus = gpuIndices(selectedGpu()).length;
  $('#gradients option[value="device"]').textContent = gpus ? 'on the GPU (fp32)' : 'beside the weights (fp32)';
  $('#grad_accum-hint').textContent = gpus > 1
    ? `micro-batches added up per step, shared among the ${gpus} GPUs (at least one each)`
    : 'micro-batches added up per step';
}

function deviceCard({ id, name, meta, free, total, used, note }) {
  const hasMemory = typeof total === 'number' && total > 0;
  return el('label', { class: 'gpu', dataset: { gpu: id } },
    el('div', { class: 'name' }, el('input', { type: 'radio', name: 'gpu', value: id, onchange: () => { describeDevice(); planChanged(); } }), name),
    el('div', { class: 'meta' }, meta),
    hasMemory ? bar(used / total) : null,
    el('div', { class: 'small muted mem' }, hasMemory ? free : ''),
    note ? el('div', { class: 'small muted' }, note) : null);
}

/**
 * One card per device, then, with two GPUs or more, the sets a data-parallel job can run on:
 * the first k GPUs for every k from 2 to all of them.
 */
function renderGpus(gpus) {
  const cards = gpus.map((gpu) => deviceCard({
    id: gpu.id,
    name: gpu.name || gpu.id,
    meta: [gpu.id, gpu.pcie ? `PCIe ${gpu.pcie}` : null].filter(Boolean).join(' · '),
    total: gpu.memory_total,
    used: gpu.memory_used,
    free: `${fmtBytes(gpu.memory_total - gpu.memory_used)} free of ${fmtBytes(gpu.memory_total)}${gpu.id === 'cpu' ? ' RAM' : ''}`,
    note: gpu.id === 'cpu' ? 'slow; fine for the tiny preset' : null,
  }));
  const singles = gpus.filter((g) => gpuIndices(g.id).length === 1)
    .sort((a, b) => gpuIndices(a.id)[0] - gpuIndices(b.id)[0]);
  for (let k = 2; k <= singles.length; k += 1) {
    const set = singles.slice(0, k);
    const id = `cuda:${set.map((g) => gpuIndices(g.id)[0]).join(',')}`;
    const withMemory = set.filter((g) => typeof g.memory_total === 'number' && g.memory_total > 0);
    const tightest = withMemory.length === set.length
      ? withMemory.reduce((a, b) => (b.memory_total - b.memory_used < a.memory_total - a.memory_used ? b : a))
      : null;
    const names = [...new Set(set.map((g) => g.name).filter(Boolean))];
    cards.push(deviceCard({
      id,
      name: `${k === singles.length ? 'All ' : ''}${k} GPUs (${id}) — data parallel`,
      meta: names.length === 1 ? `${k} × ${names[0]}` : names.join(' + '),
      total: tightest ? tightest.memory_total : null,
      used: tightest ? tightest.memory_used : null,
      free: tightest ? `${fmtBytes(tightest.memory_total - tightest.memory_used)} free on the fullest` : '',
      note: 'each GPU trains on its share of every step',
    }));
  }
  fill($('#gpus'), cards);
  const ids = cards.map((c) => c.dataset.gpu);
  const wanted = params.get('gpu');
  const firstGpu = gpus.find((g) => g.id !== 'cpu');
  const initial = ids.includes(wanted) ? wanted : (firstGpu || gpus[0] || {}).id;
  const radio = document.querySelector(`input[name="gpu"][value="${CSS.escape(initial || '')}"]`);
  if (radio) radio.checked = true;
  describeDevice();
}

/**
 * The dataset the form starts with: the one asked for in the address, else the one this user's
 * latest job trained on, else the shared demo; never one with no example to train on (the
 * newest upload may be anything, so it is not the default).
 */
function defaultDataset(sorted, jobs) {
  const usable = sorted.filter((d) => d.records > 0);
  const asked = sorted.find((d) => String(d.id) === params.get('dataset'));
  if (asked) return asked;
  const mine = jobs.filter((j) => !j.owner || j.owner === me.username).sort((a, b) => b.id - a.id);
  for (const job of mine) {
    const used = usable.find((d) => d.id === job.dataset);
    if (used) return used;
  }
  return usable.find((d) => d.owner === null) || usable[0] || sorted[0] || null;
}

function renderDatasets(jobs) {
  const sorted = [...datasets].sort((a, b) => b.id - a.id);
  fill($('#dataset'), sorted.map((d) => el('option', { value: d.id }, `${d.name} · ${fmtInt(d.records)} examples`)));
  const first = defaultDataset(sorted, jobs);
  if (first) $('#dataset').value = String(first.id);
  if (!datasets.length) {
    fill($('#dataset-hint'), 'No datasets yet: ', el('a', { href: '/datasets' }, 'upload one'), ' first.');
    $('#dataset').disabled = true;
  }
  fill($('#eval_dataset'),
    el('option', { value: '' }, 'Hold out part of the training data'),
    sorted.map((d) => el('option', { value: d.id }, `${d.name} · ${fmtInt(d.records)} examples`)));
  syncEvalFields();
}

async function main() {
  let gpus;
  let jobs;
  try {
    [models, datasets, gpus, jobs] = await Promise.all([get('/api/models'), get('/api/datasets'), get('/api/gpus'),
      // Only to start from the dataset last used: without the list the demo is the default.
      get('/api/jobs').catch(() => [])]);
  } catch (err) {
    showError($('#error'), err);
    return;
  }

  fill($('#model'), models.map((m) => el('option', { value: m.id }, `${m.name || m.id} · ${fmtCount(m.params)} params${m.kind === 'preset' ? ' · random weights' : ''}`)));
  if (models.some((m) => m.id === params.get('model'))) $('#model').value = params.get('model');
  describeModel();
  renderDatasets(Array.isArray(jobs) ? jobs : []);
  renderGpus(gpus);
  applyPreset('demo');
  if (params.get('from')) {
    try {
      await prefillFrom(params.get('from'));
    } catch (err) {
      showError($('#error'), err);
    }
  }

  $('#model').addEventListener('change', () => {
    describeModel();
    if (preset !== 'custom') applyPreset(preset);
    planChanged();
  });
  $('#dataset').addEventListener('change', () => {
    syncEvalFields();
    planChanged();
    sampleChanged();
  });
  for (const button of document.querySelectorAll('#presets button[data-preset]')) {
    if (button.dataset.preset === 'custom') continue;
    button.addEventListener('click', () => {
      applyPreset(button.dataset.preset);
      planChanged();
    });
  }
  for (const id of ALL_FIELDS) {
    const input = $(`#${id}`);
    const changed = () => {
      if (PRESET_FIELDS.has(id) && preset !== 'custom') setPreset('custom');
      if (id === 'lr') warnLr();
      if (['eval_dataset', 'eval_metric', 'eval_answer'].includes(id)) syncEvalFields();
      if (id === 'max_grad_norm') syncGradientField();
      if (['eval_dataset', 'eval_metric', 'held_out'].includes(id)) sampleChanged();
      if (id === 'eval_records') renderSample();
      planChanged();
    };
    // Number fields report every keystroke; selects and the checkbox only `change`.
    input.addEventListener(input.tagName === 'INPUT' && input.type !== 'checkbox' ? 'input' : 'change', changed);
  }

  $('#show-command').addEventListener('click', () => {
    commandOpen = !commandOpen;
    renderCommand();
  });
  $('#copy-command').addEventListener('click', async () => {
    const copied = await copyText($('#command').textContent);
    const note = $('#copy-note');
    note.textContent = copied ? 'Copied.' : 'Could not copy: select the text and copy it by hand.';
    setTimeout(() => { note.textContent = ''; }, 2500);
  });

  $('#job-form').addEventListener('submit', async (event) => {
    event.preventDefault();
    const body = jobBody();
    const submitError = $('#submit-error');
    showError(submitError, null);
    if (!datasets.length) {
      showError(submitError, new Error('Upload a dataset first.'));
      return;
    }
    if (plan && !plan.fits) {
      showError(submitError, new Error(`This job does not fit: ${plan.reason || 'not enough memory.'}`));
      return;
    }
    if (sampleError) {
      showError(submitError, new Error(`The evaluation cannot run on this data: ${labelled(sampleError).message}`));
      $('#eval_metric').focus();
      return;
    }
    // A field the plan card already calls wrong: take the person to it instead of saying it
    // a second time.
    const marked = document.querySelector('#job-form [aria-invalid="true"]');
    if (planError && marked) {
      marked.focus();
      return;
    }
    const button = $('#submit');
    button.disabled = true;
    try {
      const created = await post('/api/jobs', body);
      location.href = `/jobs/${created.id}`;
    } catch (err) {
      if (err.status === 400) markInvalid(fieldOf(err.message));
      const said = labelled(err);
      if (!planError || planError.message !== said.message) showError(submitError, said);
      button.disabled = false;
    }
  });

  await Promise.all([refreshPlan(), refreshSample()]);
}

await main();
