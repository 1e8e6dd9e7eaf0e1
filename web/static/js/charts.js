// Live metric charts on uPlot (loaded as the global `uPlot` by the page). A chart draws one or
// more fields of the job's metric points against the step; it says "not reported on this device"
// while every point lacks its fields, and "waiting for the first step" while there are none. A
// baseline (the base model's task score) is the value of a field at step 0, drawn dashed across
// the whole chart.
// Both axes are labelled: "step" on x, the unit on y. Sizes are drawn in one binary unit per
// axis (KiB, MiB or GiB, chosen from the largest value, labelled as such) and durations in ms or
// s, so the ticks are round numbers of that unit; the y axis is as wide as its longest label.
import { el } from './ui.js';

const COLORS = ['#2f6fd6', '#d07a2e', '#2c9468', '#9a6bd1'];
const HEIGHT = 190;
const FONT = '11px system-ui, sans-serif';
const LABEL_FONT = '600 11px system-ui, sans-serif';

function cssVar(name, fallback) {
  const value = getComputedStyle(document.documentElement).getPropertyValue(name).trim();
  return value || fallback;
}

const isNum = (v) => typeof v === 'number' && Number.isFinite(v);

const BYTE_UNITS = [['B', 1], ['KiB', 2 ** 10], ['MiB', 2 ** 20], ['GiB', 2 ** 30], ['TiB', 2 ** 40]];

/**
 * The y axis's unit for a chart's largest value: `{label, divisor}`. `unit` is 'bytes',
 * 'seconds', or a label shown as it is ('tokens/s'); values are divided by `divisor` to draw.
 */
export function axisUnit(unit, largest) {
  const top = isNum(largest) ? Math.abs(largest) : 0;
  if (unit === 'bytes') {
    let chosen = BYTE_UNITS[0];
    for (const candidate of BYTE_UNITS) if (top >= candidate[1]) chosen = candidate;
    return { label: chosen[0], divisor: chosen[1] };
  }
  if (unit === 'seconds') return top < 1 ? { label: 'ms', divisor: 1e-3 } : { label: 's', divisor: 1 };
  return { label: unit || '', divisor: 1 };
}

/** The decimals of a tick spacing: 0.25 -> 2, 0.5 -> 1, 5 -> 0. */
function decimalsOf(increment) {
  if (!isNum(increment) || increment <= 0) return 0;
  const text = String(Number(increment.toPrecision(6)));
  return text.includes('.') && !text.includes('e') ? text.split('.')[1].length : 0;
}

/** Tick labels: round numbers with as many decimals as the spacing needs, or e-notation when tiny. */
export function tickLabels(ticks, increment) {
  const tiny = isNum(increment) && increment < 1e-3;
  let digits = tiny ? 0 : decimalsOf(increment);
  const format = (t, d) => (t === 0 ? '0' : tiny ? t.toExponential(d).replace('e-', 'e−') : t.toLocaleString('en-US', { minimumFractionDigits: d, maximumFractionDigits: d }));
  let labels = ticks.map((t) => format(t, digits));
  for (let i = 0; i < 4 && new Set(labels).size < labels.length; i += 1) {
    digits += 1;
    labels = ticks.map((t) => format(t, digits));
  }
  return labels;
}

/** uPlot's axis size callback: room for the longest tick label, the ticks and the axis label. */
function fitLabels(self, values, axisIndex, cycle) {
  const axis = self.axes[axisIndex];
  if (cycle > 1 && axis._size) return axis._size;
  const ctx = self.ctx;
  ctx.save();
  ctx.font = FONT;
  const widest = Math.max(0, ...(values || []).map((v) => ctx.measureText(String(v ?? '')).width));
  ctx.restore();
  return Math.ceil(widest + axis.ticks.size + axis.gap + 20);
}

export class MetricChart {
  /**
   * `spec`: `{key, title, unit, series: [{field, label, sparse?}], format(value) -> string}`;
   * `unit` is the y axis's: 'bytes', 'seconds' or a label such as 'tokens/s' (see `axisUnit`);
   * `format` writes the latest value in the chart's heading.
   * A sparse series (eval loss) has points only at some steps; it is drawn as dots joined up.
   * `baseline: {field, label}`, when given, draws that field's value at step 0 as a dashed
   * horizontal line (`data-baseline` holds the value, for the browser test).
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
    this.unit = axisUnit(spec.unit, 0);
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
    const label = cssVar('--fg', '#1d2330');
    const unit = this.unit;
    const axisStyle = {
      stroke: axis, grid: { stroke: grid, width: 1 }, ticks: { stroke: grid, width: 1 }, font: FONT,
      labelFont: LABEL_FONT, labelSize: 16, labelGap: 2,
    };
    const show = (v) => (isNum(v) ? `${Number(v.toPrecision(4)).toLocaleString('en-US')}${unit.label ? ` ${unit.label}` : ''}` : '—');
    this.width = Math.max(200, Math.floor(this.plotBox.clientWidth));
    this.plot = new uPlot({
      width: this.width,
      height: HEIGHT,
      // Room on the right for the last step's label, which is centred on its tick.
      padding: [10, 14, 0, 0],
      scales: { x: { time: false } },
      legend: { show: this.lines().length > 1, live: false },
      cursor: { drag: { x: true, y: false } },
      axes: [
        { ...axisStyle, label: 'step', size: 34, values: (u, ticks) => ticks.map((t) => (Number.isInteger(t) ? t.toLocaleString('en-US') : '')) },
        {
          ...axisStyle,
          label: unit.label || this.spec.title,
          size: fitLabels,
          values: (u, ticks, i, space, increment) => {
            const labels = tickLabels(ticks, increment);
            // What the y axis shows, for the browser test (the axes are drawn on a canvas).
            this.root.dataset.yTicks = labels.join('|');
            return labels;
          },
        },
      ],
      series: [
        { label: 'step', value: (u, v) => (v === null || v === undefined ? '—' : String(v)) },
        ...this.lines().map((s, i) => ({
          label: s.label,
          stroke: s.baseline ? axis : COLORS[i % COLORS.length],
          width: s.baseline ? 1.2 : 1.6,
          dash: s.baseline ? [6, 4] : undefined,
          spanGaps: true,
          points: { show: s.baseline ? false : s.sparse ? true : undefined, size: 5 },
          value: (u, v) => show(v),
        })),
      ],
    }, [[], ...this.lines().map(() => [])], this.plotBox);
    this.root.dataset.axes = `step|${unit.label || this.spec.title}`;
  }

  /** The series drawn: the spec's, then the baseline's. */
  lines() {
    const base = this.spec.baseline;
    return base ? [...this.spec.series, { field: base.field, label: base.label, baseline: true }] : this.spec.series;
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
      // The held-out loss before training is a point of step 0 with nothing else in it.
      this.showEmpty(points.some((p) => p.step > 0) ? 'Not reported on this device' : 'Waiting for the first step…');
      return;
    }
    this.empty.hidden = true;
    let largest = 0;
    for (const p of reported) for (const f of fields) if (isNum(p[f])) largest = Math.max(largest, Math.abs(p[f]));
    const unit = axisUnit(this.spec.unit, largest);
    // A run that grows past a unit (MiB to GiB) gets an axis in the new one.
    if (this.plot && this.unit.label !== unit.label) {
      this.plot.destroy();
      this.plot = null;
    }
    this.unit = unit;
    if (!this.plot) this.makePlot();
    const xs = reported.map((p) => p.step);
    // The first step drawn (0 for the held-out loss before training), for the browser test.
    this.root.dataset.firstStep = String(xs[0]);
    const ys = fields.map((f) => reported.map((p) => (isNum(p[f]) ? p[f] / unit.divisor : null)));
    if (this.spec.baseline) {
      const start = points.find((p) => p.step === 0 && isNum(p[this.spec.baseline.field]));
      const value = start ? start[this.spec.baseline.field] : null;
      if (value === null) delete this.root.dataset.baseline;
      else this.root.dataset.baseline = String(value);
      ys.push(xs.map(() => (value === null ? null : value / unit.divisor)));
    }
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
