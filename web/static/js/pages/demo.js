// The demo view of one job, for a projector: no account needed, only the link its owner turned
// on. Large figures of the latest step (model size, TFLOPS, tokens per second, GPU and host
// memory, PCIe each way, loss) and the step's per-unit timeline, replayed at its own pace so the
// room sees the layers stream through the GPU. Fed by the demo API's server-sent events; when
// the owner turns the link off, the next reload says so.
import { renderTimeline, spansOf } from '../timeline.js';
import { $, el, fill, fmtBytes, fmtInt, fmtNum } from '../ui.js';

const token = location.pathname.split('/').pop();
const base = `/api/demo/${encodeURIComponent(token)}`;
let view = null;

const FIGURES = [
  { key: 'params', label: 'parameters', value: (v) => num(v.params, size) },
  { key: 'tflops', label: 'TFLOPS', value: (v) => num(v.point?.tflops, (x) => (x >= 10 ? fmtInt(Math.round(x)) : fmtNum(x))) },
  { key: 'tokens_per_s', label: 'tokens per second', value: (v) => num(v.point?.tokens_per_s, (x) => fmtInt(Math.round(x))) },
  { key: 'gpu_mem', label: 'GPU memory in use', value: (v) => num(v.point?.gpu_mem, (x) => fmtBytes(x)), gpuOnly: true },
  { key: 'host_mem', label: 'host memory in use', value: (v) => num(v.point?.host_mem, (x) => fmtBytes(x)) },
  { key: 'h2d', label: 'PCIe host → GPU', value: (v) => num(v.point?.h2d_gbps, (x) => `${fmtNum(x)} GB/s`), gpuOnly: true },
  { key: 'd2h', label: 'PCIe GPU → host', value: (v) => num(v.point?.d2h_gbps, (x) => `${fmtNum(x)} GB/s`), gpuOnly: true },
  { key: 'loss', label: 'loss', value: (v) => num(v.point?.loss, fmtNum) },
];

/** A parameter count as people say it: "7.6 B", "494 M", "1.0 M". */
function size(n) {
  if (n >= 1e9) return `${(n / 1e9).toFixed(n >= 1e11 ? 0 : 1)} B`;
  if (n >= 1e6) return `${(n / 1e6).toFixed(n >= 1e8 ? 0 : 1)} M`;
  return fmtInt(n);
}

function num(x, format) {
  return Number.isFinite(x) ? format(x) : '—';
}

function off(message) {
  $('#demo-body').hidden = true;
  const box = $('#demo-closed');
  box.hidden = false;
  box.textContent = message;
}

function draw() {
  const v = view;
  $('#demo-title').textContent = v.title;
  const gpu = v.gpu === 'cpu' ? 'the CPU' : v.gpu;
  // Where the job runs, in the words of its device.
  $('#demo-kicker').textContent = `Sluice · training live on ${v.gpu === 'cpu' ? 'the processor' : 'the GPU'}`;
  $('#demo-timeline-title').textContent = `Each layer's weights streaming through the ${v.gpu === 'cpu' ? 'processor' : 'GPU'}, step by step`;
  $('#demo-sub').textContent = `${v.model} on ${gpu} · ${v.status}${v.placement ? ` · ${v.placement}` : ''}`;
  const fraction = v.total_steps > 0 ? Math.min(1, v.step / v.total_steps) : 0;
  $('#demo-bar span').style.width = `${(100 * fraction).toFixed(1)}%`;
  $('#demo-step').textContent = `step ${fmtInt(v.step)} of ${fmtInt(v.total_steps)}`;
  // A CPU job has no GPU memory or PCIe to show.
  const shown = FIGURES.filter((f) => v.gpu !== 'cpu' || !f.gpuOnly);
  fill($('#demo-figures'), shown.map((f) => el('div', { class: 'demo-figure', 'data-key': f.key },
    el('span', { class: 'demo-value num' }, f.value(v)),
    el('span', { class: 'demo-label' }, f.label))));
  $('#demo-body').hidden = false;
}

// Replays the step's spans in the order they ran, over the step's own length (kept between 2
// and 12 seconds, so a fast step is still visible and a slow one does not lag behind).
function drawTimeline(point, onGpu) {
  if (!point || !spansOf(point.timeline).length) return;
  const box = $('#demo-timeline');
  renderTimeline(box, point.timeline, point.step, onGpu);
  const replay = Math.min(12, Math.max(2, Number(point.step_s) || 4));
  for (const span of box.querySelectorAll('.lane span')) {
    const left = parseFloat(span.style.left) || 0;
    span.style.animationDelay = `${(replay * left) / 100}s`;
    span.classList.add('demo-reveal');
  }
}

async function load() {
  const reply = await fetch(base, { credentials: 'omit' });
  if (reply.status === 404) return off('This demo link is off, or it never existed. Ask the job\'s owner for a new one.');
  if (!reply.ok) return off(`The appliance answered ${reply.status}; reload to try again.`);
  view = await reply.json();
  draw();
  drawTimeline(view.point, view.gpu !== 'cpu');
  listen();
}

function listen() {
  const source = new EventSource(`${base}/events`);
  source.addEventListener('metric', (event) => {
    let point;
    try { point = JSON.parse(event.data); } catch { return; }
    view.point = point;
    if (Number.isFinite(point.step)) view.step = point.step;
    draw();
    drawTimeline(point, view.gpu !== 'cpu');
  });
  source.addEventListener('status', (event) => {
    let status;
    try { status = JSON.parse(event.data); } catch { return; }
    for (const key of ['status', 'step', 'total_steps']) if (status[key] != null) view[key] = status[key];
    draw();
    if (['completed', 'failed', 'cancelled', 'interrupted'].includes(view.status)) source.close();
  });
}

$('#demo-fullscreen').addEventListener('click', () => {
  const root = document.documentElement;
  if (document.fullscreenElement) document.exitFullscreen();
  else root.requestFullscreen?.();
});

load().catch((err) => off(`Could not load the demo: ${err.message}`));
