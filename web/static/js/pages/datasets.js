// Datasets: upload with progress (a refused file lists its problems by line), the list, delete.
import { del, get, requireUser, upload } from '../api.js';
import { $, el, fill, fmtBytes, fmtDate, fmtInt, ownerName, showError } from '../ui.js';

const user = await requireUser();
const admin = user.role === 'admin';

function render(datasets) {
  const box = $('#datasets');
  if (!datasets.length) {
    fill(box, el('p', { class: 'empty' }, 'No datasets yet. Upload a .jsonl file above.'));
    return;
  }
  const sorted = [...datasets].sort((a, b) => b.id - a.id);
  fill(box, el('table', { class: 'list', id: 'datasets-table' },
    el('thead', {}, el('tr', {}, ['Name', 'Format', 'Examples', 'Size', admin ? 'Owner' : null, 'Added', '']
      .filter((h) => h !== null).map((h) => el('th', {}, h)))),
    el('tbody', {}, sorted.map((d) => el('tr', { dataset: { dataset: d.id } },
      el('td', {}, el('a', { href: `/datasets/${d.id}` }, d.name || `Dataset ${d.id}`),
        d.owner === null ? el('span', { class: 'badge', title: 'Bundled with Sluice; everyone can train on it' }, 'shared') : null),
      el('td', {}, d.format || '—'),
      el('td', { class: 'num' }, fmtInt(d.records)),
      el('td', { class: 'num' }, fmtBytes(d.size_bytes)),
      admin ? el('td', {}, d.owner === null ? 'shared' : ownerName(d.owner)) : null,
      el('td', { class: 'small muted' }, fmtDate(d.created_at)),
      el('td', { class: 'actions' },
        el('a', { class: 'btn small', href: `/datasets/${d.id}` }, 'Preview'), ' ',
        admin || d.owner === user.username
          ? el('button', { type: 'button', class: 'small danger', onclick: () => remove(d) }, 'Delete') : null))))));
}

async function refresh() {
  try {
    render(await get('/api/datasets'));
    showError($('#error'), null);
  } catch (err) {
    showError($('#error'), err);
  }
}

async function remove(dataset) {
  if (!confirm(`Delete the dataset “${dataset.name}”? Jobs that already used it keep their results.`)) return;
  try {
    await del(`/api/datasets/${dataset.id}`);
    await refresh();
  } catch (err) {
    showError($('#error'), err);
  }
}

$('#upload-form').addEventListener('submit', async (event) => {
  event.preventDefault();
  const file = $('#file').files[0];
  if (!file) return;
  const form = new FormData();
  const name = $('#name').value.trim();
  if (name) form.append('name', name);
  form.append('file', file);

  const button = $('#upload-button');
  const progress = $('#upload-progress');
  const fillBar = progress.querySelector('.bar > span');
  const status = $('#upload-status');
  showError($('#upload-error'), null);
  $('#upload-ok').hidden = true;
  button.disabled = true;
  progress.hidden = false;
  fillBar.style.width = '0%';
  status.textContent = `Sending ${file.name}…`;
  try {
    const created = await upload('/api/datasets', form, (sent, total) => {
      fillBar.style.width = `${(100 * sent) / total}%`;
      status.textContent = sent < total ? `Sending: ${fmtBytes(sent)} of ${fmtBytes(total)}`
        : 'Checking every line…';
    });
    progress.hidden = true;
    const ok = $('#upload-ok');
    const id = created && created.id;
    fill(ok, `Uploaded ${created && created.name ? created.name : file.name}`,
      created && typeof created.records === 'number' ? ` (${fmtInt(created.records)} examples)` : '', '. ',
      id !== undefined ? el('a', { href: `/datasets/${id}` }, 'See the preview') : null);
    ok.hidden = false;
    event.target.reset();
    await refresh();
  } catch (err) {
    progress.hidden = true;
    if (err.status === 422 && err.problems.length) {
      err.message = `${err.message} Nothing was kept; fix these lines and upload again:`;
    }
    showError($('#upload-error'), err);
  } finally {
    button.disabled = false;
  }
});

await refresh();
