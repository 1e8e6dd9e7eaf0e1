// The answers table of a job's task evaluation (`GET /api/jobs/{id}/answers`): each record's
// prompt and reference, the base model's answer and the tuned one's, with their scores, sorted
// by what changed or by line. Every text goes in as text: model output is never markup.
import { el, fmtInt } from '../ui.js';
import { fmtScore, metricLabel } from './job_fields.js';

/** Rows drawn at most; the rest are counted under the table. */
const MAX_ROWS = 500;

export const ORDERS = {
  better: 'Got better first',
  worse: 'Got worse first',
  line: 'By line',
};

/**
 * How much a record's score moved towards better (negative: worse); `null` without both scores.
 * Perplexity falls as a model gets better.
 */
function change(row, higherIsBetter) {
  if (typeof row.base_score !== 'number' || typeof row.tuned_score !== 'number') return null;
  const delta = row.tuned_score - row.base_score;
  return higherIsBetter ? delta : -delta;
}

function sortRows(rows, order, higherIsBetter) {
  const byLine = (a, b) => a.line - b.line;
  if (order === 'line') return [...rows].sort(byLine);
  const sign = order === 'worse' ? 1 : -1;
  return [...rows].sort((a, b) => {
    const [ca, cb] = [change(a, higherIsBetter), change(b, higherIsBetter)];
    // Records without both answers go last.
    if (ca === null || cb === null) return (ca === null) - (cb === null) || byLine(a, b);
    return sign * (ca - cb) || byLine(a, b);
  });
}

function changeWord(delta) {
  if (delta === null) return 'unknown';
  if (delta > 1e-9) return 'better';
  if (delta < -1e-9) return 'worse';
  return 'same';
}

const CHANGE_TEXT = { better: 'better', worse: 'worse', same: 'same', unknown: '' };

/** An answer cell: the text as written, or a muted note when there is none. */
function answerCell(kind, text) {
  if (typeof text !== 'string') return el('td', { class: kind }, el('span', { class: 'muted' }, 'not scored'));
  if (!text.trim()) return el('td', { class: kind }, el('span', { class: 'muted' }, '(empty)'));
  return el('td', { class: kind }, el('div', { class: 'answer-text' }, text));
}

/**
 * The table for `data` (the API's answers) in `order` ('better', 'worse' or 'line'), with a
 * line saying the figures and how many records moved which way.
 */
export function renderAnswers(data, order) {
  const metric = data.metric;
  const higher = data.higher_is_better !== false;
  const show = (v) => fmtScore(metric, v);
  const rows = Array.isArray(data.records) ? data.records : [];
  const tuned = typeof data.tuned_step === 'number';
  const counts = { better: 0, worse: 0, same: 0 };
  for (const row of rows) {
    const word = changeWord(change(row, higher));
    if (word in counts) counts[word] += 1;
  }
  const sorted = sortRows(rows, order, higher).slice(0, MAX_ROWS);
  const figures = tuned
    ? `${metricLabel(metric)}: ${show(data.base_score)} (base model) → ${show(data.tuned_score)} (step ${fmtInt(data.tuned_step)})`
    : `${metricLabel(metric)}: ${show(data.base_score)} (base model); the tuned model's answers come with the next evaluation`;
  const moved = tuned
    ? `${fmtInt(counts.better)} got better, ${fmtInt(counts.worse)} got worse, ${fmtInt(counts.same)} the same, of ${fmtInt(rows.length)} records.`
    : `${fmtInt(rows.length)} records.`;
  const head = ['Line', 'Prompt', 'Reference', 'Base model', tuned ? `Tuned (step ${fmtInt(data.tuned_step)})` : 'Tuned', higher ? 'Score' : 'Score (lower is better)'];
  const body = sorted.map((row) => {
    const word = changeWord(change(row, higher));
    return el('tr', { dataset: { line: String(row.line), change: word } },
      el('td', { class: 'num' }, fmtInt(row.line)),
      el('td', { class: 'prompt' }, el('div', { class: 'answer-text' }, String(row.prompt ?? ''))),
      el('td', { class: 'reference' }, el('div', { class: 'answer-text' }, String(row.reference ?? ''))),
      answerCell('base-answer', row.base_answer),
      answerCell('tuned-answer', row.tuned_answer),
      el('td', { class: 'num scores' },
        `${show(row.base_score)} → ${show(row.tuned_score)}`,
        CHANGE_TEXT[word] ? el('span', { class: `badge ${word === 'better' ? 'fits' : word === 'worse' ? 'nofit' : ''}`, style: { marginLeft: '0.4rem' } }, CHANGE_TEXT[word]) : null));
  });
  return [
    el('p', { class: 'small', id: 'answers-figures' }, figures),
    el('p', { class: 'small muted', id: 'answers-moved' }, moved),
    el('div', { class: 'table-scroll' }, el('table', { class: 'list answers', id: 'answers-table' },
      el('thead', {}, el('tr', {}, head.map((h) => el('th', { scope: 'col' }, h)))),
      el('tbody', {}, body))),
    rows.length > MAX_ROWS ? el('p', { class: 'small muted' }, `The first ${fmtInt(MAX_ROWS)} of ${fmtInt(rows.length)} records in this order.`) : null,
  ];
}
