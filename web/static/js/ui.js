// Small DOM and formatting helpers. Text from the server always goes in through textContent
// (never innerHTML), so a dataset or user name cannot inject markup.

/**
 * `el('a', {href: '/x', class: 'btn'}, 'text', child)`. Attributes starting with `on` are
 * listeners; `null`/`false` attributes and children are skipped.
 */
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key.startsWith('on') && typeof value === 'function') node.addEventListener(key.slice(2), value);
    else if (key === 'class') node.className = value;
    else if (key === 'dataset') Object.assign(node.dataset, value);
    else if (key === 'style') Object.assign(node.style, value);
    else if (value === true) node.setAttribute(key, '');
    else node.setAttribute(key, String(value));
  }
  append(node, children);
  return node;
}

function append(node, children) {
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : String(child));
  }
}

/** Replaces a node's children. */
export function fill(node, ...children) {
  node.replaceChildren();
  append(node, children);
  return node;
}

export const $ = (selector, root = document) => root.querySelector(selector);

/** Shows an error (ApiError or any Error) in a container; an empty call hides it. */
export function showError(container, err) {
  if (!container) return;
  if (!err) {
    container.hidden = true;
    container.replaceChildren();
    return;
  }
  // The server lists the first problems and counts the rest apart (`unlisted`); those beyond
  // the 50 shown here are added to that count.
  const listed = Array.isArray(err.problems) ? err.problems : [];
  const more = Math.max(0, listed.length - 50) + (Number.isInteger(err.unlisted) ? err.unlisted : 0);
  const problems = listed.length
    ? el('ul', {}, listed.slice(0, 50).map((p) => el('li', {}, p)),
      more > 0 ? el('li', {}, `… and ${fmtInt(more)} more`) : null)
    : null;
  fill(container, el('div', {}, err.message || String(err)), problems);
  container.className = 'alert error';
  container.hidden = false;
}

/**
 * Binary units, labelled as such: 1 GiB is 2^30 bytes (the planner and the server's messages
 * count the same way). `digits` forces the decimals (chart axes need more when ticks are close).
 */
export function fmtBytes(bytes, digits = null) {
  if (typeof bytes !== 'number' || !Number.isFinite(bytes)) return '—';
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB', 'PiB'];
  let value = bytes;
  let unit = 0;
  while (Math.abs(value) >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit += 1;
  }
  const shown = digits !== null ? digits : unit === 0 ? 0 : value >= 100 ? 0 : value >= 10 ? 1 : 2;
  return `${value.toFixed(shown)} ${units[unit]}`;
}

/** 1_500_000 -> "1.5M", 7_000_000_000 -> "7.0B". */
export function fmtCount(n) {
  if (typeof n !== 'number' || !Number.isFinite(n)) return '—';
  const abs = Math.abs(n);
  if (abs >= 1e12) return `${(n / 1e12).toFixed(1)}T`;
  if (abs >= 1e9) return `${(n / 1e9).toFixed(1)}B`;
  if (abs >= 1e6) return `${(n / 1e6).toFixed(1)}M`;
  if (abs >= 1e4) return `${(n / 1e3).toFixed(1)}K`;
  return n.toLocaleString('en-US');
}

export function fmtInt(n) {
  return typeof n === 'number' && Number.isFinite(n) ? n.toLocaleString('en-US') : '—';
}

/** A number with about 4 significant digits, or scientific notation when tiny or huge. */
export function fmtNum(x) {
  if (typeof x !== 'number' || !Number.isFinite(x)) return '—';
  const abs = Math.abs(x);
  if (abs !== 0 && (abs < 1e-3 || abs >= 1e6)) return x.toExponential(2).replace(/\.?0+e/, 'e');
  return Number(x.toPrecision(4)).toLocaleString('en-US', { maximumFractionDigits: 6 });
}

export function fmtDuration(seconds) {
  if (typeof seconds !== 'number' || !Number.isFinite(seconds) || seconds < 0) return '—';
  if (seconds < 1) return `${Math.round(seconds * 1000)} ms`;
  if (seconds < 60) return `${seconds.toFixed(seconds < 10 ? 1 : 0)} s`;
  const s = Math.round(seconds);
  const d = Math.floor(s / 86400);
  const h = Math.floor((s % 86400) / 3600);
  const m = Math.floor((s % 3600) / 60);
  if (d > 0) return `${d} d ${h} h`;
  if (h > 0) return `${h} h ${m} min`;
  return `${m} min ${s % 60} s`;
}

/** Accepts unix seconds, unix milliseconds or an ISO/SQLite date string. */
export function parseDate(value) {
  if (value === null || value === undefined || value === '') return null;
  if (typeof value === 'number') return new Date(value < 1e11 ? value * 1000 : value);
  const text = String(value);
  const date = new Date(/^\d{4}-\d\d-\d\d \d/.test(text) ? `${text.replace(' ', 'T')}Z` : text);
  return Number.isNaN(date.getTime()) ? null : date;
}

export function fmtDate(value) {
  const date = parseDate(value);
  if (!date) return '—';
  return date.toLocaleString(undefined, { dateStyle: 'medium', timeStyle: 'short' });
}

const STATUS_LABELS = {
  queued: 'Queued',
  running: 'Running',
  completed: 'Completed',
  failed: 'Failed',
  cancelled: 'Cancelled',
  interrupted: 'Interrupted',
};

export function statusBadge(status) {
  return el('span', { class: `badge ${status || ''}`, dataset: { status: status || '' } },
    STATUS_LABELS[status] || status || 'unknown');
}

/** A horizontal bar filled to `fraction` (clamped); over 1 turns red. */
export function bar(fraction, { tall = false, title = null } = {}) {
  const f = typeof fraction === 'number' && Number.isFinite(fraction) ? fraction : 0;
  return el('div', { class: tall ? 'bar tall' : 'bar', title },
    el('span', { class: f > 1 ? 'over' : null, style: { width: `${Math.max(0, Math.min(1, f)) * 100}%` } }));
}

/** The id at the end of the page's path (`/jobs/12` -> 12). */
export function idFromPath() {
  const last = location.pathname.split('/').filter(Boolean).pop();
  return /^\d+$/.test(last || '') ? Number(last) : null;
}

/** A job's or dataset's owner, as the API may send it (a name, or a user object). */
export function ownerName(owner) {
  if (owner === null || owner === undefined) return '—';
  if (typeof owner === 'object') return owner.username || owner.name || String(owner.id ?? '—');
  return String(owner);
}

/** Calls `fn` after `ms` of quiet. */
export function debounce(fn, ms) {
  let timer = null;
  return (...args) => {
    clearTimeout(timer);
    timer = setTimeout(() => fn(...args), ms);
  };
}

/**
 * Puts text on the clipboard. The Clipboard API needs a secure context (https or localhost), and
 * an appliance is often reached over plain http on the local network: there the text is copied
 * through a selection instead. Resolves to whether it worked.
 */
export async function copyText(text) {
  if (navigator.clipboard && window.isSecureContext) {
    try {
      await navigator.clipboard.writeText(text);
      return true;
    } catch {
      // Denied (no user gesture, or a policy): try the selection below.
    }
  }
  const area = el('textarea', { readonly: true, 'aria-hidden': 'true', class: 'offscreen' });
  area.value = text;
  document.body.append(area);
  area.select();
  let ok = false;
  try {
    ok = document.execCommand('copy');
  } catch {
    ok = false;
  }
  area.remove();
  return ok;
}
