// Datasets: upload with progress (a refused file lists its problems by line; a lenient one
// lists what it skipped), a table's columns mapped to a format's fields or a LLaMA-Factory
// dataset_info.json sent beside the file, the list, delete with the disk it frees.
import { del, get, requireUser, upload } from '../api.js';
import { $, el, fill, fmtBytes, fmtDate, fmtInt, ownerName, showError } from '../ui.js';
import { datasetDeleteQuestion } from './job_fields.js';

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
      el('td', {}, d.format || '—', d.registry_name
        ? el('span', { class: 'small muted', title: 'Read as its dataset_info.json entry says' }, ` (${d.registry_name})`) : null),
      el('td', { class: 'num' }, fmtInt(d.records)),
      el('td', { class: 'num' }, fmtBytes(d.size_bytes)),
      admin ? el('td', {}, d.owner === null ? 'shared' : ownerName(d.owner)) : null,
      el('td', { class: 'small muted' }, fmtDate(d.created_at)),
      el('td', { class: 'actions' },
        el('a', { class: 'btn small', href: `/datasets/${d.id}` }, 'Preview'), ' ',
        admin || d.owner === user.username
          ? el('button', { type: 'button', class: 'small danger', onclick: () => remove(d) }, 'Delete') : null))))));
}

// The fields a column can be mapped to, and the column names each is usually found under (the
// server's automatic mapping uses the same).
const ROLES = [
  ['instruction', ['instruction', 'question', 'prompt', 'query', 'problem']],
  ['input', ['input', 'context']],
  ['output', ['output', 'response', 'answer', 'completion', 'solution']],
  ['system', ['system', 'system_prompt']],
  ['prompt', []],
  ['completion', []],
  ['text', ['text']],
  ['messages', ['messages']],
  ['conversations', ['conversations']],
];

/** Shows a select per field with `columns` as its choices, each preset to its usual column. */
function showColumns(columns, note) {
  const box = $('#columns-box');
  if (!columns.length) {
    box.hidden = true;
    fill($('#columns'));
    return;
  }
  const used = new Set();
  fill($('#columns'), ROLES.map(([role, usual]) => {
    const guess = usual.find((name) => columns.includes(name) && !used.has(name));
    if (guess) used.add(guess);
    const select = el('select', { id: `column-${role}`, dataset: { role } },
      el('option', { value: '' }, '—'),
      columns.map((c) => el('option', { value: c }, c)));
    select.value = guess || '';
    return el('div', { class: 'field' }, el('label', { for: `column-${role}` }, role), select);
  }));
  if (note) $('#columns-note').textContent = note;
  box.hidden = false;
}

/** `role=column,...` from the selects; empty when no mapping is shown. */
function chosenColumns() {
  if ($('#columns-box').hidden) return '';
  return [...document.querySelectorAll('#columns select')]
    .filter((s) => s.value).map((s) => `${s.dataset.role}=${s.value}`).join(',');
}

/** A CSV or TSV file's header, read in the browser (the first line; quotes undone). */
async function headerOf(file) {
  const lower = file.name.toLowerCase();
  const delimiter = lower.endsWith('.tsv') ? '\t' : lower.endsWith('.csv') ? ',' : null;
  if (!delimiter) return [];
  const first = (await file.slice(0, 64 * 1024).text()).replace(/^\ufeff/, '').split(/\r?\n/)[0];
  return first.split(delimiter).map((c) => c.trim().replace(/^"(.*)"$/, '$1').replace(/""/g, '"')).filter(Boolean);
}

$('#file').addEventListener('change', async () => {
  const file = $('#file').files[0];
  showColumns(file ? await headerOf(file) : []);
});

async function refresh() {
  try {
    render(await get('/api/datasets'));
    showError($('#error'), null);
  } catch (err) {
    showError($('#error'), err);
  }
}

/** A line above the list saying what was just done; empty hides it. */
function notice(text) {
  $('#notice').textContent = text;
  $('#notice').hidden = !text;
}

async function remove(dataset) {
  try {
    const resumable = await get(`/api/datasets/${dataset.id}/resumable-jobs`);
    if (!confirm(datasetDeleteQuestion(dataset, resumable))) return;
    const done = await del(`/api/datasets/${dataset.id}`);
    notice(`Deleted “${dataset.name}”: ${fmtBytes(done.freed_bytes)} freed.`);
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
  if ($('#skip-invalid').checked) form.append('skip_invalid', 'true');
  const columns = chosenColumns();
  if (columns) form.append('columns', columns);
  const registry = $('#dataset-info').files[0];
  if (registry) {
    form.append('dataset_info', await registry.text());
    const entry = $('#registry-dataset').value.trim();
    if (entry) form.append('dataset', entry);
  }
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
    const skipped = created && created.skipped > 0 ? created.skipped_records || [] : [];
    fill(ok, `Uploaded ${created && created.name ? created.name : file.name}`,
      created && typeof created.records === 'number'
        ? ` (${fmtInt(created.records)} example${created.records === 1 ? '' : 's'} kept)` : '', '. ',
      id !== undefined ? el('a', { href: `/datasets/${id}` }, 'See the preview') : null,
      skipped.length ? el('div', { id: 'upload-skipped' },
        el('p', {}, `${fmtInt(created.skipped)} invalid records were skipped:`),
        el('ul', { class: 'problems' }, skipped.map((s) => el('li', {}, `${unitOf(created.layout)} ${s.line}: ${s.reason}`))),
        created.skipped > skipped.length ? el('p', { class: 'small muted' }, `… and ${fmtInt(created.skipped - skipped.length)} more`) : null)
        : null);
    ok.hidden = false;
    event.target.reset();
    showColumns([]);
    await refresh();
  } catch (err) {
    progress.hidden = true;
    const named = err.status === 422 && /the columns \((.*)\) are not/.exec(err.message || '');
    if (named) {
      showColumns(named[1].split(', '), 'Its columns are not named as a format\'s: choose which column holds what, then upload again.');
    } else if (err.status === 422 && err.problems.length) {
      err.message = `${err.message} Nothing was kept; fix these lines and upload again, or tick “Skip invalid records”:`;
    }
    showError($('#upload-error'), err);
  } finally {
    button.disabled = false;
  }
});

/** What a layout's record numbers count. */
function unitOf(layout) {
  return layout === 'json' ? 'record' : layout === 'parquet' ? 'row' : 'line';
}

// The dataset page deletes, then comes back here to say so.
notice(sessionStorage.getItem('sluice.notice') || '');
sessionStorage.removeItem('sluice.notice');
await refresh();
