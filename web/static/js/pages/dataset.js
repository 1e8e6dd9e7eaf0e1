// One dataset: its first examples as the chosen model sees them (trained tokens highlighted),
// which tokenizer and template rendered them, the records a lenient upload skipped, token
// statistics and a length histogram.
import { del, firstData, get, requireUser } from '../api.js';
import { $, el, fill, fmtBytes, fmtInt, idFromPath, showError } from '../ui.js';
import { datasetDeleteQuestion } from './job_fields.js';

const me = await requireUser();
const id = idFromPath();
const error = $('#error');

function fact(label, value, key) {
  return el('div', { class: 'fact', dataset: { stat: key } }, el('div', { class: 'k' }, label), el('div', { class: 'v' }, value));
}

function renderSamples(samples) {
  if (!samples.length) {
    fill($('#samples'), el('p', { class: 'empty' }, 'This dataset has no examples.'));
    return;
  }
  fill($('#samples'), samples.map((sample, i) => el('div', {},
    el('div', { class: 'small muted sample-head' }, [typeof sample.line === 'number' ? `line ${sample.line}` : `example ${i + 1}`,
      typeof sample.tokens === 'number' ? `${fmtInt(sample.tokens)} tokens` : null].filter(Boolean).join(' · ')),
    el('pre', { class: 'sample', dataset: { sample: i } },
      (sample.segments || []).map((seg) => el('span', { class: seg.trained ? 'trained' : 'prompt' }, seg.text))))));
}

function renderStats(stats) {
  const records = stats.records;
  const tokens = stats.tokens;
  fill($('#stats'),
    fact('Examples', fmtInt(records), 'records'),
    fact('Tokens', fmtInt(tokens), 'tokens'),
    fact('Trained tokens', fmtInt(stats.trained_tokens), 'trained_tokens'),
    fact('Mean length', records > 0 && typeof tokens === 'number' ? fmtInt(Math.round(tokens / records)) : '—', 'mean'),
    fact('Cut short', fmtInt(stats.truncated), 'truncated'));
  const notes = [];
  if (typeof stats.measured === 'number' && typeof records === 'number' && stats.measured < records) {
    notes.push(`Counted over the first ${fmtInt(stats.measured)} examples.`);
  }
  if (stats.truncated > 0) {
    const [one, verb] = stats.truncated === 1 ? ['example is', 'loses its end'] : ['examples are', 'lose their ends'];
    notes.push(`${fmtInt(stats.truncated)} ${one} longer than ${typeof stats.seq_len === 'number' ? `${fmtInt(stats.seq_len)} tokens (the sequence length)` : 'the sequence length'} and ${verb} in training.`);
  }
  if (stats.continued > 0) {
    const one = stats.continued === 1 ? 'text is' : 'texts are';
    notes.push(`${fmtInt(stats.continued)} ${one} longer than ${typeof stats.seq_len === 'number' ? `${fmtInt(stats.seq_len)} tokens` : 'the sequence length'} and go${stats.continued === 1 ? 'es' : ''} on in the next row: text is packed, not cut.`);
  }
  fill($('#stats-notes'), notes.join(' '));
}

/** Buckets may come as plain counts or as objects with a count and bounds. */
function normalizeBuckets(lengths) {
  return (lengths || []).map((b, i) => {
    if (typeof b === 'number') return { count: b, label: `bucket ${i + 1}`, parts: [`bucket ${i + 1}`] };
    const count = b.count ?? b.n ?? 0;
    const lo = b.min ?? b.start ?? b.from ?? b.lo;
    const hi = b.max ?? b.end ?? b.to ?? b.hi ?? b.le;
    const label = lo !== undefined && hi !== undefined ? `${lo}–${hi}` : hi !== undefined ? `≤ ${hi}` : lo !== undefined ? `≥ ${lo}` : `bucket ${i + 1}`;
    // The range may break after its dash onto a second line, so a narrow column shows it whole.
    const parts = lo !== undefined && hi !== undefined ? [`${lo}–`, el('wbr'), String(hi)] : [label];
    return { count, label, parts, lo, hi };
  });
}

function renderHistogram(lengths) {
  const buckets = normalizeBuckets(lengths);
  const box = $('#histogram');
  if (!buckets.length) {
    fill(box, el('p', { class: 'empty' }, 'No lengths reported.'));
    return;
  }
  const max = Math.max(1, ...buckets.map((b) => b.count));
  fill(box, el('div', { class: 'histogram', role: 'img', 'aria-label': 'histogram of example lengths in tokens' },
    buckets.map((b) => el('div', { class: 'bucket', title: `${b.label} tokens: ${fmtInt(b.count)} examples` },
      el('span', { class: 'count' }, b.count > 0 ? fmtInt(b.count) : ''),
      // 75%: the count above and the range below take the rest of the column.
      el('div', { class: 'col', style: { height: `${(75 * b.count) / max}%` } }),
      el('span', { class: 'range' }, b.parts)))));
}

/** The records a lenient upload left out, as training leaves them out. */
function renderSkipped(dataset) {
  const listed = dataset.skipped_records || [];
  $('#skipped-card').hidden = !(dataset.skipped > 0);
  if (!(dataset.skipped > 0)) return;
  const unit = dataset.layout === 'json' ? 'record' : dataset.layout === 'parquet' ? 'row' : 'line';
  $('#skipped-note').textContent = `${fmtInt(dataset.skipped)} invalid records were skipped at upload and are left out of training; ${fmtInt(dataset.records)} are kept.`
    + (dataset.skipped > listed.length ? ` The first ${fmtInt(listed.length)}:` : '');
  fill($('#skipped'), listed.map((s) => el('li', {}, `${unit} ${s.line}: ${s.reason}`)));
}

async function loadPreview() {
  const model = $('#model').value;
  fill($('#samples'), el('p', { class: 'empty' }, 'Loading…'));
  try {
    const preview = await get(`/api/datasets/${id}/preview?model=${encodeURIComponent(model)}&limit=5`);
    renderSamples(preview.samples || []);
    const rendered = preview.rendered_with || {};
    fill($('#rendered-with'), rendered.summary || '',
      rendered.chat_template ? el('details', {}, el('summary', { class: 'small muted' }, 'The chat template'),
        el('pre', { class: 'sample' }, rendered.chat_template)) : null);
    renderStats(preview.stats || {});
    renderHistogram((preview.stats || {}).lengths);
    showError(error, null);
  } catch (err) {
    fill($('#samples'));
    showError(error, err);
  }
}

async function main() {
  if (id === null) return;
  let dataset;
  let models;
  try {
    const given = firstData('dataset');
    [dataset, models] = await Promise.all([given ?? get(`/api/datasets/${id}`), get('/api/models')]);
  } catch (err) {
    if (err.status === 404) err.message = 'There is no dataset here, or it belongs to someone else.';
    showError(error, err);
    fill($('#samples'));
    for (const button of document.querySelectorAll('.page-head .buttons > *')) button.hidden = true;
    return;
  }
  document.title = `${dataset.name} · Sluice`;
  $('#title').textContent = dataset.name || `Dataset ${id}`;
  const mapped = Object.entries(dataset.columns || {}).map(([role, column]) => `${role} ← ${column}`).join(', ');
  $('#subtitle').textContent = [dataset.format, dataset.layout ? dataset.layout.toUpperCase() : null,
    `${fmtInt(dataset.records)} examples`, dataset.skipped > 0 ? `${fmtInt(dataset.skipped)} skipped` : null,
    fmtBytes(dataset.size_bytes), mapped ? `columns: ${mapped}` : null,
    dataset.registry_name ? `dataset_info.json entry “${dataset.registry_name}”` : null]
    .filter(Boolean).join(' · ');
  $('#train-link').href = `/jobs/new?dataset=${id}`;
  renderSkipped(dataset);
  $('#delete').hidden = !(me.role === 'admin' || dataset.owner === me.username);

  const select = $('#model');
  fill(select, models.map((m) => el('option', { value: m.id }, `${m.name || m.id}${m.kind === 'preset' ? ' (preset)' : ''}`)));
  const stored = sessionStorage.getItem('sluice.previewModel');
  if (stored && models.some((m) => m.id === stored)) select.value = stored;
  select.addEventListener('change', () => {
    sessionStorage.setItem('sluice.previewModel', select.value);
    loadPreview();
  });

  $('#delete').addEventListener('click', async () => {
    try {
      const resumable = await get(`/api/datasets/${id}/resumable-jobs`);
      if (!confirm(datasetDeleteQuestion(dataset, resumable))) return;
      const done = await del(`/api/datasets/${id}`);
      sessionStorage.setItem('sluice.notice', `Deleted “${dataset.name}”: ${fmtBytes(done.freed_bytes)} freed.`);
      location.href = '/datasets';
    } catch (err) {
      showError(error, err);
    }
  });
  await loadPreview();
}

await main();
