// Models: presets and local folders with their family and size.
import { get, requireUser } from '../api.js';
import { $, el, fill, fmtCount, showError } from '../ui.js';

await requireUser();

try {
  const models = await get('/api/models');
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
