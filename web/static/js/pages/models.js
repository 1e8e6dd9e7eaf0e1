// Models: presets, local folders and Hugging Face snapshots with their family and size; pulls
// from the Hub by name and GGUF imports, with progress.
import { get, post, requireUser, upload } from '../api.js';
import { $, bar, el, fill, fmtBytes, fmtCount, showError } from '../ui.js';

await requireUser();

const ORIGINS = {
  folder: 'Local folder',
  pulled: 'Pulled from the Hub',
  'hf-cache': 'Hugging Face cache',
};

async function refresh() {
  try {
    const models = await get('/api/models');
    showError($('#error'), null);
    // Real models first: those are the ones to train.
    const order = { pulled: 0, 'hf-cache': 1, folder: 2, preset: 3 };
    const sorted = [...models].sort((a, b) => (order[a.origin] ?? 4) - (order[b.origin] ?? 4) || String(a.name).localeCompare(String(b.name)));
    fill($('#models'), models.length === 0 ? el('p', { class: 'empty' }, 'No models found.')
      : el('table', { class: 'list', id: 'models-table' },
        el('thead', {}, el('tr', {}, ['Name', 'Kind', 'Family', 'Parameters', ''].map((h) => el('th', {}, h)))),
        el('tbody', {}, sorted.map((m) => el('tr', { dataset: { model: m.id } },
          el('td', {}, el('div', {}, m.name || m.id), el('div', { class: 'small muted mono' }, m.id)),
          el('td', { title: m.description || null }, m.kind === 'preset'
            ? [el('div', {}, 'Preset: random weights'), el('div', { class: 'small muted' }, 'for trying the appliance, not for real use')]
            : ORIGINS[m.origin] || m.kind || '—'),
          el('td', {}, m.family || '—', m.note ? el('div', { class: 'small muted' }, m.note) : null),
          el('td', { class: 'num', title: typeof m.params === 'number' ? m.params.toLocaleString('en-US') : null }, fmtCount(m.params)),
          el('td', { class: 'actions' }, el('a', { class: 'btn small', href: `/jobs/new?model=${encodeURIComponent(m.id)}` }, 'Train')))))));
  } catch (err) {
    fill($('#models'));
    showError($('#error'), err);
  }
}

$('#gguf-form').addEventListener('submit', async (event) => {
  event.preventDefault();
  const file = $('#gguf-file').files[0];
  if (!file) return;
  const form = new FormData();
  const name = $('#gguf-name').value.trim();
  if (name) form.append('name', name);
  form.append('file', file);

  const button = $('#gguf-button');
  const progress = $('#gguf-progress');
  const fillBar = progress.querySelector('.bar > span');
  const status = $('#gguf-status');
  showError($('#gguf-error'), null);
  $('#gguf-ok').hidden = true;
  button.disabled = true;
  progress.hidden = false;
  fillBar.style.width = '0%';
  status.textContent = `Sending ${file.name}…`;
  try {
    const created = await upload('/api/models/import', form, (sent, total) => {
      fillBar.style.width = `${(100 * sent) / total}%`;
      status.textContent = sent < total ? `Sending: ${fmtBytes(sent)} of ${fmtBytes(total)}`
        : 'Converting the weights…';
    });
    progress.hidden = true;
    const ok = $('#gguf-ok');
    fill(ok, `Imported ${created && created.id ? created.id : file.name}`,
      created && typeof created.params === 'number' ? ` (${fmtCount(created.params)} parameters)` : '', '. ',
      created && created.id ? el('a', { href: `/jobs/new?model=${encodeURIComponent(created.id)}` }, 'Train it') : null);
    ok.hidden = false;
    event.target.reset();
    await refresh();
  } catch (err) {
    progress.hidden = true;
    showError($('#gguf-error'), err);
  } finally {
    button.disabled = false;
  }
});

// Pulls: shown while they run and after they end (done or why they failed), polled once a
// second while one runs.
let polling = null;
let lastStates = {};

function pullRow(p) {
  const fraction = p.total > 0 ? p.done / p.total : 0;
  const current = (p.files || []).find((f) => f.done < f.total);
  const what = p.state === 'running'
    ? `${fmtBytes(p.done)} of ${fmtBytes(p.total)}${current ? ` · ${current.name}` : ''}`
    : p.state === 'done' ? `Done: ${fmtBytes(p.total)}` : 'Failed';
  return el('div', { class: 'pull', dataset: { repo: p.repo, state: p.state } },
    el('div', {}, el('strong', {}, p.repo), el('span', { class: 'muted mono small' }, ` @ ${p.revision}`)),
    el('div', { class: 'progress-line' }, bar(p.state === 'done' ? 1 : fraction),
      el('span', { class: 'small muted pull-status' }, what)),
    p.state === 'failed' && p.error ? el('div', { class: 'alert error small', role: 'alert' }, p.error) : null,
    p.state === 'done' && p.model ? el('div', { class: 'small' }, `Listed as `, el('code', {}, p.model), '. ',
      el('a', { href: `/jobs/new?model=${encodeURIComponent(p.model)}` }, 'Train it')) : null);
}

async function refreshPulls() {
  let pulls;
  try {
    pulls = await get('/api/models/pulls');
  } catch (err) {
    showError($('#pull-error'), err);
    return;
  }
  fill($('#pulls'), pulls.map(pullRow));
  // A pull that just ended changes the list of models.
  const ended = pulls.some((p) => p.state !== 'running' && lastStates[p.repo] === 'running');
  lastStates = Object.fromEntries(pulls.map((p) => [p.repo, p.state]));
  if (ended) await refresh();
  const running = pulls.some((p) => p.state === 'running');
  if (running && !polling) polling = setInterval(refreshPulls, 1000);
  if (!running && polling) {
    clearInterval(polling);
    polling = null;
  }
}

$('#pull-form').addEventListener('submit', async (event) => {
  event.preventDefault();
  const repo = $('#pull-repo').value.trim();
  const revision = $('#pull-revision').value.trim();
  if (!repo) return;
  const button = $('#pull-button');
  showError($('#pull-error'), null);
  button.disabled = true;
  try {
    await post('/api/models/pull', revision ? { repo, revision } : { repo });
    lastStates[repo] = 'running';
    await refreshPulls();
  } catch (err) {
    showError($('#pull-error'), err);
  } finally {
    button.disabled = false;
  }
});

await refresh();
await refreshPulls();
