// New job: model, dataset, device, settings with presets, and the planner's verdict fetched live
// as the settings change. Submitting is refused (with the reason) when the plan does not fit.
import { get, post, requireUser } from '../api.js';
import { $, bar, debounce, el, fill, fmtBytes, fmtCount, fmtDuration, fmtInt, showError } from '../ui.js';

await requireUser();

// Settings a newcomer can start from. `lr` depends on the model: random-init presets learn
// fast with a large rate; pretrained weights need a small one not to forget what they know.
const PRESETS = {
  demo: {
    hint: 'A short run to see training work: about a minute for the tiny preset, even on the processor.',
    values: { steps: 20, seq_len: 128, micro_batch: 4, grad_accum: 1, schedule: 'cosine', warmup: 2, weight_decay: 0, max_grad_norm: 1, save_every: 10, seed: 0 },
    lr: { preset: 1e-3, local: 2e-5 },
  },
  finetune: {
    hint: 'A real fine-tune: longer sequences, 8 micro-batches per step, a checkpoint every 100 steps.',
    values: { steps: 500, seq_len: 1024, micro_batch: 1, grad_accum: 8, schedule: 'cosine', warmup: 20, weight_decay: 0, max_grad_norm: 1, save_every: 100, seed: 0 },
    lr: { preset: 1e-3, local: 2e-5 },
  },
};
const FIELDS = ['steps', 'seq_len', 'micro_batch', 'grad_accum', 'lr', 'schedule', 'warmup', 'weight_decay', 'max_grad_norm', 'save_every', 'seed'];
const TIER_LABELS = { host: 'Host memory (RAM)', gpu: 'GPU memory' };
const PART_COLORS = ['#4c8be0', '#36a87a', '#d08a2e', '#9a6bd1', '#d05a7a', '#3fb0c0', '#8a8f3a', '#7a7f8c'];

let models = [];
let preset = 'demo';
let plan = null;
let planError = null;

const params = new URLSearchParams(location.search);

function selectedModel() {
  return models.find((m) => m.id === $('#model').value);
}

function selectedGpu() {
  const checked = document.querySelector('input[name="gpu"]:checked');
  return checked ? checked.value : null;
}

function applyPreset(name) {
  preset = name;
  for (const button of document.querySelectorAll('#presets button')) {
    button.setAttribute('aria-pressed', String(button.dataset.preset === name));
  }
  const p = PRESETS[name];
  $('#preset-hint').textContent = p ? p.hint : 'Your own settings.';
  if (!p) return;
  for (const [key, value] of Object.entries(p.values)) $(`#${key}`).value = value;
  const model = selectedModel();
  $('#lr').value = p.lr[model && model.kind === 'local' ? 'local' : 'preset'];
}

function readForm() {
  const number = (id) => {
    const raw = $(`#${id}`).value.trim();
    return raw === '' ? null : Number(raw);
  };
  return {
    model: $('#model').value,
    dataset: Number($('#dataset').value),
    gpu: selectedGpu(),
    steps: number('steps'),
    seq_len: number('seq_len'),
    micro_batch: number('micro_batch'),
    grad_accum: number('grad_accum'),
    lr: number('lr'),
    schedule: $('#schedule').value,
    warmup: number('warmup') ?? 0,
    weight_decay: number('weight_decay') ?? 0,
    max_grad_norm: number('max_grad_norm') ?? 0,
    // 0 or empty: save only at the end (the API's "none").
    save_every: number('save_every') || null,
    seed: number('seed') ?? 0,
  };
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
    title: `${p.name}: ${fmtBytes(p.bytes)}`,
    style: { width: `${(100 * p.bytes) / scale}%`, background: PART_COLORS[i % PART_COLORS.length] },
  }));
  const barNode = parts.length ? el('div', { class: 'bar tall' }, segments) : bar(capacity > 0 ? used / capacity : 0, { tall: true });
  return el('div', { class: 'tier', dataset: { tier: tier.name } },
    el('div', { class: 'tier-head' },
      el('strong', {}, TIER_LABELS[tier.name] || tier.name),
      el('span', { class: over ? 'num' : 'num muted', style: over ? { color: 'var(--danger)', fontWeight: 600 } : {} },
        capacity > 0 ? `${fmtBytes(used)} of ${fmtBytes(capacity)}${over ? ' — too much' : ''}` : fmtBytes(used))),
    barNode,
    parts.length ? el('div', { class: 'legend' }, parts.map((p, i) => el('span', {},
      el('i', { style: { background: PART_COLORS[i % PART_COLORS.length] } }), `${p.name} ${fmtBytes(p.bytes)}`))) : null);
}

function renderPlan() {
  const box = $('#plan');
  const verdict = $('#plan-verdict');
  const submit = $('#submit');
  const note = $('#submit-note');
  if (planError) {
    fill(verdict);
    fill(box, el('div', { class: 'alert error' }, planError.message));
    submit.disabled = false;
    note.textContent = '';
    return;
  }
  if (!plan) return;
  const form = readForm();
  fill(verdict, el('span', { class: `badge ${plan.fits ? 'fits' : 'nofit'}`, id: 'plan-fits', dataset: { fits: String(plan.fits) } },
    plan.fits ? 'Fits' : 'Does not fit'));
  const tokensPerStep = (form.seq_len || 0) * (form.micro_batch || 0) * (form.grad_accum || 0);
  const total = typeof plan.step_time_s === 'number' && form.steps ? plan.step_time_s * form.steps : null;
  fill(box,
    plan.reason ? el('p', { class: plan.fits ? 'muted' : '', id: 'plan-reason' }, plan.reason) : null,
    el('div', { class: 'facts' },
      fact('Step time', fmtDuration(plan.step_time_s), 'step_time'),
      fact('Whole run', total === null ? '—' : `≈ ${fmtDuration(total)}`, 'total_time'),
      fact('Bottleneck', plan.bottleneck || '—', 'bottleneck'),
      fact('Tokens / step', fmtInt(tokensPerStep), 'tokens')),
    el('h3', { style: { marginTop: '1rem' } }, 'Memory'),
    (plan.tiers || []).map(renderTier));
  submit.disabled = !plan.fits;
  note.textContent = plan.fits ? '' : `Cannot start: ${plan.reason || 'the job does not fit this device.'}`;
}

let planSeq = 0;
async function refreshPlan() {
  const form = readForm();
  if (!form.model || !form.gpu || !form.seq_len || !form.micro_batch || !form.grad_accum) return;
  const seq = ++planSeq;
  $('#plan-card').classList.add('loading');
  try {
    const result = await post('/api/plan', {
      model: form.model, gpu: form.gpu, seq_len: form.seq_len, micro_batch: form.micro_batch, grad_accum: form.grad_accum,
    });
    if (seq !== planSeq) return;
    plan = result;
    planError = null;
  } catch (err) {
    if (seq !== planSeq) return;
    plan = null;
    planError = err;
  }
  $('#plan-card').classList.remove('loading');
  renderPlan();
}
const refreshPlanSoon = debounce(refreshPlan, 250);

function renderGpus(gpus) {
  const wanted = params.get('gpu');
  const firstGpu = gpus.find((g) => g.id !== 'cpu');
  const initial = gpus.some((g) => g.id === wanted) ? wanted : (firstGpu || gpus[0] || {}).id;
  fill($('#gpus'), gpus.map((gpu) => {
    const hasMemory = typeof gpu.memory_total === 'number' && gpu.memory_total > 0;
    return el('label', { class: 'gpu', dataset: { gpu: gpu.id } },
      el('div', { class: 'name' }, el('input', { type: 'radio', name: 'gpu', value: gpu.id, checked: gpu.id === initial, onchange: refreshPlanSoon }), gpu.name || gpu.id),
      el('div', { class: 'meta' }, [gpu.id, gpu.pcie ? `PCIe ${gpu.pcie}` : null].filter(Boolean).join(' · ')),
      hasMemory ? bar(gpu.memory_used / gpu.memory_total) : null,
      el('div', { class: 'small muted', style: { marginTop: '0.3rem' } },
        hasMemory ? `${fmtBytes(gpu.memory_total - gpu.memory_used)} free of ${fmtBytes(gpu.memory_total)}${gpu.id === 'cpu' ? ' RAM' : ''}` : ''),
      gpu.id === 'cpu' ? el('div', { class: 'small muted' }, 'slow; fine for the tiny preset') : null);
  }));
}

async function main() {
  let datasets;
  let gpus;
  try {
    [models, datasets, gpus] = await Promise.all([get('/api/models'), get('/api/datasets'), get('/api/gpus')]);
  } catch (err) {
    showError($('#error'), err);
    return;
  }

  fill($('#model'), models.map((m) => el('option', { value: m.id }, `${m.name || m.id} · ${fmtCount(m.params)} params${m.kind === 'preset' ? ' · random weights' : ''}`)));
  if (models.some((m) => m.id === params.get('model'))) $('#model').value = params.get('model');
  const describeModel = () => {
    const m = selectedModel();
    $('#model-hint').textContent = m ? [m.family, m.kind === 'preset' ? 'preset, starts from random weights' : 'local folder'].filter(Boolean).join(' · ') : '';
  };
  describeModel();

  const sortedDatasets = [...datasets].sort((a, b) => b.id - a.id);
  fill($('#dataset'), sortedDatasets.map((d) => el('option', { value: d.id }, `${d.name} · ${fmtInt(d.records)} examples`)));
  if (sortedDatasets.some((d) => String(d.id) === params.get('dataset'))) $('#dataset').value = params.get('dataset');
  if (!datasets.length) {
    fill($('#dataset-hint'), 'No datasets yet: ', el('a', { href: '/datasets' }, 'upload one'), ' first.');
    $('#dataset').disabled = true;
  }

  renderGpus(gpus);
  applyPreset('demo');

  $('#model').addEventListener('change', () => {
    describeModel();
    if (preset !== 'custom') applyPreset(preset);
    refreshPlanSoon();
  });
  for (const button of document.querySelectorAll('#presets button[data-preset]')) {
    if (button.dataset.preset === 'custom') continue;
    button.addEventListener('click', () => {
      applyPreset(button.dataset.preset);
      refreshPlanSoon();
    });
  }
  for (const id of FIELDS) {
    $(`#${id}`).addEventListener('input', () => {
      if (preset !== 'custom') {
        preset = 'custom';
        for (const b of document.querySelectorAll('#presets button')) b.setAttribute('aria-pressed', String(b.dataset.preset === 'custom'));
        $('#preset-hint').textContent = 'Your own settings.';
      }
      if (['seq_len', 'micro_batch', 'grad_accum'].includes(id)) refreshPlanSoon();
      else renderPlan();
    });
  }

  $('#job-form').addEventListener('submit', async (event) => {
    event.preventDefault();
    const form = readForm();
    const submitError = $('#submit-error');
    if (!datasets.length) {
      showError(submitError, new Error('Upload a dataset first.'));
      return;
    }
    if (plan && !plan.fits) {
      showError(submitError, new Error(`This job does not fit: ${plan.reason || 'not enough memory.'}`));
      return;
    }
    const button = $('#submit');
    button.disabled = true;
    try {
      const created = await post('/api/jobs', form);
      location.href = `/jobs/${created.id}`;
    } catch (err) {
      showError(submitError, err);
      button.disabled = false;
    }
  });

  await refreshPlan();
}

await main();
