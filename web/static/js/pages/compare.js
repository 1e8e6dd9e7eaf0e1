// Jobs side by side (`/jobs/compare?ids=3,5`): their train and eval loss curves (and their task
// metric, when they share one) on shared charts, their results (the task evaluation's figure as
// base → tuned among them), and their settings with the rows that differ marked.
import { get, requireUser } from '../api.js';
import { MetricChart } from '../charts.js';
import { $, el, fill, fmtBytes, fmtInt, fmtNum, showError, statusBadge } from '../ui.js';
import { deviceLabel, fmtScore, metricLabel, modelLabel, runDuration, settingsList } from './job_fields.js';

await requireUser();
const MAX_JOBS = 8;
const error = $('#error');

function idsFromQuery() {
  const raw = new URLSearchParams(location.search).get('ids') || '';
  const ids = [...new Set(raw.split(',').map((s) => s.trim()).filter((s) => /^\d+$/.test(s)).map(Number))];
  return ids.slice(0, MAX_JOBS);
}

const label = (job) => (job.name ? `${job.name} (#${job.id})` : `#${job.id}`);

/** One array of points by step, with each job's values under `loss_<id>` and `eval_<id>`. */
function mergedPoints(jobs, histories) {
  const byStep = new Map();
  jobs.forEach((job, i) => {
    for (const p of histories[i] || []) {
      if (typeof p.step !== 'number') continue;
      const row = byStep.get(p.step) || { step: p.step };
      if (typeof p.loss === 'number') row[`loss_${job.id}`] = p.loss;
      if (typeof p.eval_loss === 'number') row[`eval_${job.id}`] = p.eval_loss;
      if (typeof p.task_score === 'number') row[`task_${job.id}`] = p.task_score;
      byStep.set(p.step, row);
    }
  });
  return [...byStep.values()].sort((a, b) => a.step - b.step);
}

/** Rows of `[label, value per job]` for what describes a job besides its settings. */
function describing(jobs) {
  return [
    { key: 'model', label: 'Model', values: jobs.map((j) => modelLabel(j.model)) },
    { key: 'dataset', label: 'Dataset', values: jobs.map((j) => j.dataset_name || (j.dataset ? `#${j.dataset}` : 'deleted')) },
    { key: 'eval_dataset', label: 'Evaluation dataset', values: jobs.map((j) => j.eval_dataset_name || '—') },
    { key: 'gpu', label: 'Device', values: jobs.map((j) => deviceLabel(j.gpu)) },
  ];
}

function settingRows(jobs) {
  const lists = jobs.map((j) => settingsList(j.config, j.save_interval, j.eval_dataset !== null && j.eval_dataset !== undefined));
  const keys = [];
  const labels = new Map();
  for (const list of lists) {
    for (const row of list) {
      if (!labels.has(row.key)) {
        keys.push(row.key);
        labels.set(row.key, row.label);
      }
    }
  }
  const settings = keys.map((key) => ({
    key,
    label: labels.get(key),
    values: lists.map((list) => (list.find((r) => r.key === key) || { value: '—' }).value),
  }));
  return [...describing(jobs), ...settings];
}

function renderSettings(jobs) {
  const rows = settingRows(jobs);
  let differing = 0;
  const body = rows.map((row) => {
    const differs = new Set(row.values).size > 1;
    if (differs) differing += 1;
    return el('tr', { class: differs ? 'differs' : null, dataset: { setting: row.key, differs: String(differs) } },
      el('th', { scope: 'row' }, row.label, differs ? el('span', { class: 'badge warn', style: { marginLeft: '0.4rem' } }, 'differs') : null),
      row.values.map((v) => el('td', {}, differs ? el('mark', {}, v) : v)));
  });
  $('#diff-count').textContent = differing === 0 ? 'The jobs ran with the same settings.'
    : `${differing} of ${rows.length} rows differ.`;
  fill($('#compare-settings'), el('table', { class: 'list wide', id: 'settings-table' },
    el('thead', {}, el('tr', {}, el('th', {}, 'Setting'), jobs.map((j) => el('th', {}, el('a', { href: `/jobs/${j.id}` }, label(j)))))),
    el('tbody', {}, body)));
}

function renderResults(jobs) {
  const loss = (v) => (typeof v === 'number' ? fmtNum(v) : '—');
  const rows = [
    ['Status', (j) => statusBadge(j.status)],
    ['Steps', (j) => `${fmtInt(j.step)}${j.total_steps ? ` of ${fmtInt(j.total_steps)}` : ''}`],
    ['Final loss', (j) => loss(j.summary && j.summary.final_loss)],
    ['Best loss', (j) => loss(j.summary && j.summary.best_loss)],
    ['Final eval loss', (j) => loss(j.summary && j.summary.final_eval_loss)],
    ['Best eval loss', (j) => loss(j.summary && j.summary.best_eval_loss)],
    ['Eval metric', (j) => metricLabel(j.task ? j.task.metric : 'loss'), 'eval_metric'],
    ['Base → tuned', taskFigures, 'task'],
    ['Tokens seen', (j) => (j.summary && typeof j.summary.tokens_seen === 'number' ? fmtInt(j.summary.tokens_seen) : '—')],
    ['Throughput', (j) => (j.summary && typeof j.summary.tokens_per_s === 'number' ? `${fmtNum(j.summary.tokens_per_s)} tok/s` : '—')],
    ['Duration', runDuration],
    ['Disk used', (j) => fmtBytes(j.disk_bytes || 0)],
  ];
  fill($('#compare-results'), el('table', { class: 'list wide', id: 'results-table' },
    el('thead', {}, el('tr', {}, el('th', {}, ''), jobs.map((j) => el('th', {}, el('a', { href: `/jobs/${j.id}` }, label(j)))))),
    el('tbody', {}, rows.map(([name, value, key]) => el('tr', { dataset: key ? { result: key } : {} },
      el('th', { scope: 'row' }, name), jobs.map((j) => el('td', { dataset: { job: String(j.id) } }, value(j))))))));
}

/**
 * A job's task evaluation as "base → tuned": the base model's figure (before step 1) and the
 * latest evaluation's, with which way is better.
 */
function taskFigures(job) {
  if (!job.task) return '—';
  const s = job.summary || {};
  const show = (v) => fmtScore(job.task.metric, v);
  const has = (v) => typeof v === 'number';
  if (!has(s.task_before) && !has(s.task_score)) return 'not scored yet';
  const text = `${has(s.task_before) ? show(s.task_before) : '—'} → ${has(s.task_score) ? show(s.task_score) : '—'}`;
  return job.task.higher_is_better ? text : `${text} (lower is better)`;
}

async function main() {
  const ids = idsFromQuery();
  if (ids.length < 2) {
    showError(error, new Error('Choose two or more jobs to compare: tick them in the dashboard\'s list.'));
    return;
  }
  let jobs;
  let histories;
  try {
    jobs = await Promise.all(ids.map((id) => get(`/api/jobs/${id}`)));
    histories = await Promise.all(ids.map((id) => get(`/api/jobs/${id}/metrics`)));
  } catch (err) {
    if (err.status === 404) err.message = 'One of these jobs does not exist, or belongs to someone else.';
    showError(error, err);
    return;
  }
  document.title = `Compare ${jobs.map((j) => `#${j.id}`).join(', ')} · Sluice`;
  $('#compare-body').hidden = false;
  const points = mergedPoints(jobs, histories);
  const specs = [
    { key: 'loss', title: 'Training loss', series: jobs.map((j) => ({ field: `loss_${j.id}`, label: label(j) })), format: fmtNum },
    { key: 'eval_loss', title: 'Eval loss', series: jobs.map((j) => ({ field: `eval_${j.id}`, label: label(j), sparse: true })), format: fmtNum },
  ];
  // The task metric on one chart when the jobs that have one share it (figures of different
  // metrics do not go on one axis).
  const tasked = jobs.filter((j) => j.task);
  const metrics = new Set(tasked.map((j) => j.task.metric));
  if (metrics.size === 1) {
    const [metric] = metrics;
    const name = metricLabel(metric);
    specs.push({ key: 'task_score', title: name, unit: metric === 'bleu' ? 'BLEU' : name.toLowerCase(), series: tasked.map((j) => ({ field: `task_${j.id}`, label: label(j), sparse: true })), format: (v) => fmtScore(metric, v) });
  }
  // Eval loss only where some job evaluated: an empty chart would only say "not reported".
  const evaluated = points.some((p) => jobs.some((j) => typeof p[`eval_${j.id}`] === 'number'));
  for (const spec of specs.filter((s) => s.key !== 'eval_loss' || evaluated)) {
    new MetricChart($('#compare-charts'), spec).update(points);
  }
  renderResults(jobs);
  renderSettings(jobs);
}

await main();
