// Live metric charts on uPlot (loaded as the global `uPlot` by the page). A chart draws one or
// more fields of the job's metric points against the step; it says "not reported on this device"
// while every point lacks its fields, and "waiting for the first step" while there are none.
import { el } from './ui.js';

const COLORS = ['#2f6fd6', '#d07a2e', '#36a87a', '#9a6bd1'];
const HEIGHT = 170;

function cssVar(name, fallback) {
  const value = getComputedStyle(document.documentElement).getPropertyValue(name).trim();
  return value || fallback;
}

const isNum = (v) => typeof v === 'number' && Number.isFinite(v);

/** Axis labels, with more digits when close ticks would otherwise read the same. */
function tickLabels(ticks, format) {
  let labels = ticks.map((t) => format(t));
  for (let digits = 2; digits <= 5 && new Set(labels).size < labels.length; digits += 1) {
    labels = ticks.map((t) => format(t, digits));
  }
  return labels;
}

export class MetricChart {
  /**
   * `spec`: `{key, title, series: [{field, label, sparse?}], format(value) -> string}`.
   * A sparse series (eval loss) has points only at some steps; it is drawn as dots joined up.
   */
  constructor(parent, spec) {
    this.spec = spec;
    this.latest = el('span', { class: 'latest' });
    this.plotBox = el('div', { class: 'plot' });
    this.empty = el('div', { class: 'chart-empty' }, 'Waiting for the first step…');
    this.root = el('div', { class: 'chart', dataset: { chart: spec.key, points: '0' } },
      el('h3', {}, el('span', {}, spec.title), this.latest), this.plotBox, this.empty);
    parent.append(this.root);
    this.plot = null;
    this.width = 0;
    new ResizeObserver(() => this.resize()).observe(this.plotBox);
  }

  resize() {
    const width = Math.floor(this.plotBox.clientWidth);
    if (!this.plot || width <= 0 || width === this.width) return;
    this.width = width;
    this.plot.setSize({ width, height: HEIGHT });
  }

  makePlot() {
    const axis = cssVar('--muted', '#5b6475');
    const grid = cssVar('--line', '#e2e5eb');
    const format = this.spec.format;
    const axisStyle = { stroke: axis, grid: { stroke: grid, width: 1 }, ticks: { stroke: grid, width: 1 }, font: '11px system-ui, sans-serif' };
    this.width = Math.max(200, Math.floor(this.plotBox.clientWidth));
    this.plot = new uPlot({
      width: this.width,
      height: HEIGHT,
      scales: { x: { time: false } },
      legend: { show: this.spec.series.length > 1, live: false },
      cursor: { drag: { x: true, y: false } },
      axes: [
        { ...axisStyle, size: 34, values: (u, ticks) => ticks.map((t) => (Number.isInteger(t) ? String(t) : '')) },
        { ...axisStyle, size: 64, values: (u, ticks) => tickLabels(ticks, format) },
      ],
      series: [
        { label: 'step', value: (u, v) => (v === null || v === undefined ? '—' : String(v)) },
        ...this.spec.series.map((s, i) => ({
          label: s.label,
          stroke: COLORS[i % COLORS.length],
          width: 1.6,
          spanGaps: true,
          points: { show: s.sparse ? true : undefined, size: 5 },
          value: (u, v) => (v === null || v === undefined ? '—' : format(v)),
        })),
      ],
    }, [[], ...this.spec.series.map(() => [])], this.plotBox);
  }

  /** Redraws from the job's points (sorted by step). */
  update(points) {
    const fields = this.spec.series.map((s) => s.field);
    const reported = points.filter((p) => fields.some((f) => isNum(p[f])));
    this.root.dataset.points = String(reported.length);
    if (!points.length) {
      this.showEmpty('Waiting for the first step…');
      return;
    }
    if (!reported.length) {
      this.showEmpty('Not reported on this device');
      return;
    }
    this.empty.hidden = true;
    if (!this.plot) this.makePlot();
    const xs = reported.map((p) => p.step);
    const ys = fields.map((f) => reported.map((p) => (isNum(p[f]) ? p[f] : null)));
    this.plot.setData([xs, ...ys]);
    const last = reported[reported.length - 1];
    this.latest.textContent = isNum(last[fields[0]]) ? this.spec.format(last[fields[0]]) : '';
  }

  showEmpty(text) {
    this.empty.textContent = text;
    this.empty.hidden = false;
    this.latest.textContent = '';
  }
}
