// Models: presets and local folders with their family and size; GGUF import with progress.
import { get, requireUser, upload } from '../api.js';
import { $, el, fill, fmtBytes, fmtCount, showError } from '../ui.js';

await requireUser();

async function refresh() {
  try {
    const models = await get('/api/models');
    showError($('#error'), null);
    const order = { preset: 0, local: 1 };
    const sorted = [...models].sort((a, b) => (order[a.kind] ?? 2) - (order[b.kind] ?? 2) || String(a.name).localeCompare(String(b.name)));
    fill($('#models'), models.length === 0 ? el('p', { class: 'empty' }, 'No models found.')
      : el('table', { class: 'list', id: 'models-table' },
        el('thead', {}, el('tr', {}, ['Name', 'Kind', 'Family', 'Parameters', ''].map((h) => el('th', {}, h)))),
        el('tbody', {}, sorted.map((m) => el('tr', { dataset: { model: m.id } },
          el('td', {}, el('div', {}, m.name || m.id), el('div', { class: 'small muted mono' }, m.id)),
          el('td', {}, m.kind === 'preset' ? 'Preset (random weights)' : m.kind === 'local' ? 'Local folder' : (m.kind || '—')),
          el('td', {}, m.family || '—'),
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

await refresh();
