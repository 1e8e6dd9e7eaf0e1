// Storage, for administrators: each account's datasets, runs and checkpoints on disk with its
// quota (set here), and the shared model folders, each with a delete that says what it frees.
import { del, get, request, requireUser } from '../api.js';
import { $, bar, el, fill, fmtBytes, fmtInt, showError } from '../ui.js';

await requireUser();
const error = $('#error');
const GIB = 1024 ** 3;

function notice(text) {
  $('#notice').textContent = text;
  $('#notice').hidden = !text;
}

function quotaCell(user) {
  const input = el('input', {
    type: 'number', min: '0', step: '0.1', style: { width: '7rem' }, 'aria-label': `Quota of ${user.username} in GiB`,
    placeholder: 'none', value: typeof user.quota_bytes === 'number' ? String(Number((user.quota_bytes / GIB).toPrecision(6))) : null,
    dataset: { quota: user.username },
  });
  const save = async () => {
    const raw = input.value.trim();
    const quota = raw === '' ? null : Math.round(Number(raw) * GIB);
    if (quota !== null && !(Number.isFinite(quota) && quota >= 0)) {
      showError(error, new Error('A quota is a number of GiB, 0 or more; empty for none.'));
      return;
    }
    try {
      await request('PUT', `/api/storage/users/${user.id}/quota`, { quota_bytes: quota });
      notice(quota === null ? `${user.username} has no quota.` : `${user.username} may use up to ${fmtBytes(quota)}.`);
      await refresh();
    } catch (err) {
      showError(error, err);
    }
  };
  return el('div', { class: 'buttons' }, input, el('span', { class: 'small muted' }, 'GiB'),
    el('button', { type: 'button', class: 'small', dataset: { saveQuota: user.username }, onclick: save }, 'Set'));
}

function renderUsers(users) {
  fill($('#storage-users'), el('table', { class: 'list', id: 'storage-table' },
    el('thead', {}, el('tr', {}, ['Account', 'Jobs', 'Datasets', 'Runs', 'of which checkpoints', 'Total', 'Quota'].map((h) => el('th', {}, h)))),
    el('tbody', {}, users.map((u) => el('tr', { dataset: { user: u.username } },
      el('td', {}, u.username),
      el('td', { class: 'num' }, fmtInt(u.jobs)),
      el('td', { class: 'num' }, fmtBytes(u.datasets_bytes)),
      el('td', { class: 'num' }, fmtBytes(u.runs_bytes)),
      el('td', { class: 'num' }, fmtBytes(u.checkpoints_bytes)),
      el('td', { class: 'num', dataset: { total: u.username } }, fmtBytes(u.total_bytes),
        typeof u.quota_bytes === 'number' && u.quota_bytes > 0 ? bar(Math.min(1, u.total_bytes / u.quota_bytes), { title: 'share of the quota in use' }) : null,
        typeof u.quota_bytes === 'number' && u.total_bytes >= u.quota_bytes ? el('div', { class: 'small', style: { color: 'var(--danger)' } }, 'over quota') : null),
      el('td', {}, quotaCell(u)))))));
}

async function removeModel(model) {
  if (!confirm(`Delete the model “${model.name}”? This frees ${fmtBytes(model.bytes)}. Jobs that trained it keep their checkpoints.`)) return;
  try {
    const done = await del(`/api/storage/models/${encodeURIComponent(model.name)}`);
    notice(`Deleted ${model.name}: ${fmtBytes(done.freed_bytes)} freed.`);
    await refresh();
  } catch (err) {
    showError(error, err);
  }
}

function renderModels(models) {
  if (!models.length) {
    fill($('#storage-models'), el('p', { class: 'empty' }, 'No model folders or pulled models.'));
    return;
  }
  fill($('#storage-models'), el('table', { class: 'list', id: 'models-table' },
    el('thead', {}, el('tr', {}, ['Model', 'From', 'Size', ''].map((h) => el('th', {}, h)))),
    el('tbody', {}, models.map((m) => el('tr', { dataset: { model: m.name } },
      el('td', {}, m.origin === 'pulled' ? m.name.replace(/^hf:/, '') : m.name),
      el('td', { class: 'small muted' }, m.origin === 'pulled' ? 'pulled from the Hub' : 'models/ folder'),
      el('td', { class: 'num' }, fmtBytes(m.bytes)),
      el('td', { class: 'actions' }, m.active_jobs > 0
        ? el('span', { class: 'small muted' }, `in use by ${m.active_jobs} job${m.active_jobs === 1 ? '' : 's'}`)
        : el('button', { type: 'button', class: 'small danger', onclick: () => removeModel(m) }, `Delete (frees ${fmtBytes(m.bytes)})`)))))));
}

async function refresh() {
  try {
    const storage = await get('/api/storage');
    renderUsers(storage.users || []);
    renderModels(storage.models || []);
    $('#shared-bytes').textContent = fmtBytes(storage.shared_datasets_bytes || 0);
    showError(error, null);
  } catch (err) {
    showError(error, err);
  }
}

await refresh();
