// The per-unit stream timeline of the last step: one lane per stream (h2d, compute, d2h,
// optimizer), one bar per unit's work on it, placed by its start and end within the step.
//
// A metric point may carry `timeline` in either form:
//   [{"unit": 3, "stream": "h2d", "start": 0.012, "end": 0.019}, ...]      (seconds from step start)
//   {"units": [{"unit": 3, "h2d": [0.012, 0.019], "compute": [...], ...}, ...]}
import { el, fill, fmtDuration } from './ui.js';

const STREAMS = ['h2d', 'compute', 'd2h', 'optimizer'];
// A job on the processor has no device to copy to: its "copies" are memcpy within host memory.
const LABELS = {
  gpu: { h2d: 'host → GPU', compute: 'compute', d2h: 'GPU → host', optimizer: 'optimizer' },
  cpu: { h2d: 'copy in', compute: 'compute', d2h: 'copy out', optimizer: 'optimizer' },
};

/** Flattens either accepted form into `[{unit, stream, start, end}]`; malformed entries are skipped. */
export function spansOf(timeline) {
  const spans = [];
  const push = (unit, stream, start, end) => {
    if (Number.isFinite(start) && Number.isFinite(end) && end >= start) spans.push({ unit, stream: String(stream), start, end });
  };
  if (Array.isArray(timeline)) {
    for (const s of timeline) if (s && typeof s === 'object') push(s.unit, s.stream, Number(s.start), Number(s.end));
  } else if (timeline && Array.isArray(timeline.units)) {
    for (const u of timeline.units) {
      if (!u || typeof u !== 'object') continue;
      for (const [key, value] of Object.entries(u)) {
        if (key !== 'unit' && Array.isArray(value) && value.length === 2) push(u.unit, key, Number(value[0]), Number(value[1]));
      }
    }
  }
  return spans;
}

/**
 * Draws the timeline into `box`; returns false when the point carries none. `onGpu` says
 * whether the job ran on a GPU, which names the copy lanes.
 */
export function renderTimeline(box, timeline, step, onGpu = true) {
  const labels = LABELS[onGpu ? 'gpu' : 'cpu'];
  const spans = spansOf(timeline);
  if (!spans.length) return false;
  const t0 = Math.min(...spans.map((s) => s.start));
  const t1 = Math.max(...spans.map((s) => s.end));
  const length = Math.max(t1 - t0, 1e-9);
  const streams = [...STREAMS.filter((s) => spans.some((x) => x.stream === s)),
    ...new Set(spans.map((s) => s.stream).filter((s) => !STREAMS.includes(s)))];
  fill(box,
    el('p', { class: 'small muted' }, `Step ${step}: ${fmtDuration(length)} from the first transfer to the last update.`),
    el('div', { class: 'timeline' }, streams.map((stream) => el('div', { class: 'row' },
      el('span', { class: 'muted', dataset: { lane: stream } }, labels[stream] || stream),
      el('div', { class: 'lane' }, spans.filter((s) => s.stream === stream).map((s) => el('span', {
        class: STREAMS.includes(stream) ? `s-${stream}` : 's-other',
        title: `unit ${s.unit}: ${fmtDuration(s.start - t0)} – ${fmtDuration(s.end - t0)}`,
        style: { left: `${(100 * (s.start - t0)) / length}%`, width: `${(100 * (s.end - s.start)) / length}%` },
      })))))));
  return true;
}
