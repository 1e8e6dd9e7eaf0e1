// Every page on a phone (390 x 844) in dark mode, and at 1280 px in light mode: nothing scrolls
// the page sideways, the top bar's menu folds behind a button that works from the keyboard, a
// "Skip to content" link comes first, the focus ring shows, and text is readable against what is
// behind it (WCAG AA: 4.5:1, or 3:1 for large text) in both themes, measured on the computed
// colours. Saves docs/screenshots/<page>-390.png (dark) and <page>-1280.png (light).
import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';

import { openBrowser } from './harness.mjs';
import { startServer } from './server.mjs';

const PHONE = { width: 390, height: 844 };
const SMALL_PHONE = { width: 360, height: 740 };
const DESKTOP = { width: 1280, height: 860 };
const ADMIN = { username: 'grace', password: 'a long enough password' };
// Tall pages are cut here so that a screenshot stays readable and under 300 KB.
const MAX_SHOT_HEIGHT = { 390: 2600, 1280: 1800 };

let server;
let browser;
let page;

before(async () => {
  server = await startServer();
  browser = await openBrowser({ viewport: PHONE, colorScheme: 'dark' });
  ({ page } = browser);
});

after(async () => {
  if (browser) await browser.close();
  if (server) await server.stop();
});

const url = (p) => `${server.url}${p}`;

/**
 * Runs in the page: the contrast of every visible piece of text against the colour behind it,
 * and of the focused element's outline against the page. Colours are the computed ones, with
 * translucent backgrounds composited over their ancestors'.
 */
function audit() {
  const channels = (text) => {
    const m = /^rgba?\(([^)]+)\)$/.exec(text.trim());
    if (!m) return null;
    const parts = m[1].split(/[\s,/]+/).filter(Boolean).map(Number);
    return { r: parts[0], g: parts[1], b: parts[2], a: parts.length > 3 ? parts[3] : 1 };
  };
  const over = (top, bottom) => ({
    r: top.r * top.a + bottom.r * (1 - top.a),
    g: top.g * top.a + bottom.g * (1 - top.a),
    b: top.b * top.a + bottom.b * (1 - top.a),
    a: 1,
  });
  const luminance = ({ r, g, b }) => {
    const lin = (v) => {
      const c = v / 255;
      return c <= 0.03928 ? c / 12.92 : ((c + 0.055) / 1.055) ** 2.4;
    };
    return 0.2126 * lin(r) + 0.7152 * lin(g) + 0.0722 * lin(b);
  };
  const ratio = (x, y) => {
    const [hi, lo] = [luminance(x), luminance(y)].sort((p, q) => q - p);
    return (hi + 0.05) / (lo + 0.05);
  };
  // The solid colour behind an element: its own and its ancestors' backgrounds, composited.
  const background = (node) => {
    const layers = [];
    for (let n = node; n && n.nodeType === 1; n = n.parentElement) {
      const c = channels(getComputedStyle(n).backgroundColor);
      if (c && c.a > 0) {
        layers.push(c);
        if (c.a >= 1) break;
      }
    }
    let colour = { r: 255, g: 255, b: 255, a: 1 };
    for (const layer of layers.reverse()) colour = over(layer, colour);
    return colour;
  };
  const describe = (n) => `${n.tagName.toLowerCase()}${n.id ? `#${n.id}` : ''}${n.className && typeof n.className === 'string' ? `.${n.className.trim().split(/\s+/).join('.')}` : ''}`;

  const failures = [];
  let checked = 0;
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  const seen = new Set();
  for (let t = walker.nextNode(); t; t = walker.nextNode()) {
    const node = t.parentElement;
    if (!t.textContent.trim() || !node || seen.has(node)) continue;
    seen.add(node);
    // Disabled controls are exempt from the contrast rule; hidden text is not seen.
    if (node.closest('[disabled], [hidden], [aria-hidden="true"]') || !node.checkVisibility({ opacityProperty: true, visibilityProperty: true })) continue;
    const style = getComputedStyle(node);
    const fg = channels(style.color);
    if (!fg) continue;
    const bg = background(node);
    const size = parseFloat(style.fontSize);
    const bold = Number(style.fontWeight) >= 700;
    const large = size >= 24 || (bold && size >= 18.66);
    const needed = large ? 3 : 4.5;
    const got = ratio(over(fg, bg), bg);
    checked += 1;
    if (got < needed) failures.push(`${describe(node)} "${t.textContent.trim().slice(0, 30)}": ${got.toFixed(2)} < ${needed}`);
  }
  return { checked, failures };
}

/** The contrast of the first visible primary button's text on its own background. */
async function primaryContrast() {
  return page.evaluate(() => {
    const button = [...document.querySelectorAll('button.primary, .btn.primary')].find((b) => b.checkVisibility());
    if (!button) return null;
    const parse = (text) => text.match(/[\d.]+/g).slice(0, 3).map(Number);
    const lum = (rgb) => {
      const [r, g, b] = rgb.map((v) => {
        const c = v / 255;
        return c <= 0.03928 ? c / 12.92 : ((c + 0.055) / 1.055) ** 2.4;
      });
      return 0.2126 * r + 0.7152 * g + 0.0722 * b;
    };
    const style = getComputedStyle(button);
    const [hi, lo] = [lum(parse(style.color)), lum(parse(style.backgroundColor))].sort((a, b) => b - a);
    return { text: button.textContent.trim(), ratio: (hi + 0.05) / (lo + 0.05) };
  });
}

// The page's width, and the outermost elements that reach past the window (to say which).
const noSidewaysScroll = () => page.evaluate(() => {
  const past = [...document.body.querySelectorAll('*')]
    .filter((n) => n.getBoundingClientRect().right > window.innerWidth + 0.5)
    .filter((n, _, all) => !all.includes(n.parentElement))
    .slice(0, 5)
    .map((n) => `${n.tagName.toLowerCase()}${n.id ? `#${n.id}` : ''}.${String(n.className).replace(/\s+/g, '.')} (right ${Math.round(n.getBoundingClientRect().right)})`);
  return { scrollWidth: document.documentElement.scrollWidth, innerWidth: window.innerWidth, past };
});

async function assertNoSidewaysScroll(name) {
  const { scrollWidth, innerWidth, past } = await noSidewaysScroll();
  assert.ok(scrollWidth <= innerWidth, `${name}: the page scrolls sideways (${scrollWidth} px wide in a ${innerWidth} px window): ${past.join(', ')}`);
}

/** Both themes: text contrast over the whole page, and the primary button's. */
async function assertContrast(name) {
  for (const scheme of ['dark', 'light']) {
    await page.emulateMedia({ colorScheme: scheme });
    const { checked, failures } = await page.evaluate(audit);
    assert.ok(checked > 5, `${name} (${scheme}): only ${checked} texts checked`);
    assert.deepEqual(failures, [], `${name} (${scheme}): text below WCAG AA contrast`);
    const primary = await primaryContrast();
    if (primary) {
      assert.ok(primary.ratio >= 4.5, `${name} (${scheme}): the primary button "${primary.text}" has ${primary.ratio.toFixed(2)}:1`);
    }
  }
  await page.emulateMedia({ colorScheme: 'dark' });
}

/** The element that has focus, as the test needs to know it. */
const focused = () => page.evaluate(() => {
  const a = document.activeElement;
  if (!a || a === document.body) return null;
  const style = getComputedStyle(a);
  return {
    id: a.id,
    cls: a.className,
    text: a.textContent.trim(),
    top: a.getBoundingClientRect().top,
    outline: style.outlineStyle !== 'none' ? parseFloat(style.outlineWidth) : 0,
    outlineColor: style.outlineColor,
    boxShadow: style.boxShadow,
    focusVisible: a.matches(':focus-visible'),
  };
});

/** The skip link is the first thing Tab reaches, shows when focused and moves focus to main. */
async function assertSkipLink(name) {
  const first = await page.evaluate(() => {
    const tabbable = [...document.querySelectorAll('a[href], button, input, select, textarea, summary, [tabindex]')]
      .filter((n) => !n.disabled && n.tabIndex >= 0 && n.checkVisibility());
    return tabbable[0] ? { cls: tabbable[0].className, text: tabbable[0].textContent.trim() } : null;
  });
  assert.deepEqual(first, { cls: 'skip-link', text: 'Skip to content' }, `${name}: the first focusable element`);
  // From the top of the page, by keyboard.
  // (Focusing the body for a moment puts the start of the tab order at the top of the page,
  // even on pages whose first field has autofocus.)
  await page.evaluate(() => {
    window.scrollTo(0, 0);
    document.body.tabIndex = -1;
    document.body.focus();
    document.body.removeAttribute('tabindex');
  });
  await page.keyboard.press('Tab');
  const skip = await focused();
  assert.equal(skip?.text, 'Skip to content', `${name}: Tab from the top reached ${JSON.stringify(skip)}`);
  assert.ok(skip.top >= 0, `${name}: the focused skip link is off-screen (top ${skip.top})`);
  await page.keyboard.press('Enter');
  assert.equal((await focused())?.id, 'main', `${name}: the skip link did not move focus to the content`);
}

/** A button focused from the keyboard draws a ring of at least 2 px (or a shadow). */
async function assertFocusRing(name, selector) {
  await page.evaluate(() => document.activeElement?.blur());
  // Focus the element before it, then Tab: focus from the keyboard, as a person would.
  await page.evaluate((sel) => {
    const target = document.querySelector(sel);
    const all = [...document.querySelectorAll('a[href], button, input, select, textarea, summary, [tabindex]')]
      .filter((n) => !n.disabled && n.tabIndex >= 0 && n.checkVisibility());
    const before = all[all.indexOf(target) - 1];
    before.focus();
  }, selector);
  await page.keyboard.press('Tab');
  const ring = await focused();
  assert.ok(ring && (await page.evaluate((sel) => document.activeElement === document.querySelector(sel), selector)),
    `${name}: Tab did not reach ${selector}: ${JSON.stringify(ring)}`);
  assert.ok(ring.focusVisible, `${name}: ${selector} is not :focus-visible`);
  assert.ok(ring.outline >= 2 || (ring.boxShadow && ring.boxShadow !== 'none'),
    `${name}: no visible focus ring on ${selector}: ${JSON.stringify(ring)}`);
}

/** On a phone the navigation folds behind the menu button, which opens and closes by keyboard. */
async function assertMenu(name) {
  const link = page.locator('#menu nav a[href="/datasets"]');
  assert.ok(await page.locator('#menu-button').isVisible(), `${name}: no menu button on a phone`);
  assert.ok(await link.isHidden(), `${name}: the navigation is not folded on a phone`);
  await assertFocusRing(name, '#menu-button');
  await page.keyboard.press('Enter');
  assert.equal(await page.getAttribute('#menu-button', 'aria-expanded'), 'true');
  await link.waitFor({ state: 'visible' });
  await assertNoSidewaysScroll(`${name} (menu open)`);
  // The menu comes next in the tab order, then Escape closes it and gives focus back.
  await page.keyboard.press('Tab');
  assert.equal(await page.evaluate(() => document.activeElement.closest('#menu') !== null), true, `${name}: Tab after the menu button left the menu`);
  await page.keyboard.press('Escape');
  assert.equal(await page.getAttribute('#menu-button', 'aria-expanded'), 'false');
  assert.ok(await link.isHidden(), `${name}: Escape did not close the menu`);
  assert.equal((await focused())?.id, 'menu-button', `${name}: Escape did not return focus to the menu button`);
  await page.keyboard.press(' ');
  await link.waitFor({ state: 'visible' });
  await page.keyboard.press(' ');
  await link.waitFor({ state: 'hidden' });
}

async function shoot(name, width, maxHeight = MAX_SHOT_HEIGHT[width]) {
  const height = await page.evaluate(() => document.documentElement.scrollHeight);
  await page.evaluate(() => window.scrollTo(0, 0));
  await browser.screenshot(`${name}-${width}`, {
    fullPage: true,
    clip: { x: 0, y: 0, width, height: Math.min(height, maxHeight) },
  });
}

/**
 * Everything about one page: on a phone in dark mode, then on a small phone, then at 1280 px in
 * light mode (reloaded, so the charts draw in the light theme's colours). `ready` waits for its
 * content; `focusTarget` is a button to check the focus ring on where the page has no menu.
 */
async function checkPage(name, { ready, nav = true, focusTarget = null, desktopShotHeight }) {
  await page.setViewportSize(PHONE);
  await page.emulateMedia({ colorScheme: 'dark' });
  await page.reload();
  await ready();
  await assertNoSidewaysScroll(`${name} at 390 px`);
  await assertSkipLink(name);
  if (nav) await assertMenu(name);
  else await assertFocusRing(name, focusTarget);
  await assertContrast(name);
  await page.emulateMedia({ colorScheme: 'dark' });
  await page.evaluate(() => document.activeElement?.blur());
  await shoot(name, 390);

  await page.setViewportSize(SMALL_PHONE);
  // Charts follow their box's width a frame later.
  await page.evaluate(() => new Promise((resolve) => requestAnimationFrame(() => requestAnimationFrame(resolve))));
  await assertNoSidewaysScroll(`${name} at 360 px`);

  await page.setViewportSize(DESKTOP);
  await page.emulateMedia({ colorScheme: 'light' });
  await page.reload();
  await ready();
  await assertNoSidewaysScroll(`${name} at 1280 px`);
  await page.evaluate(() => document.activeElement?.blur());
  if (nav) {
    assert.ok(await page.locator('#menu-button').isHidden(), `${name}: a menu button at 1280 px`);
    assert.ok(await page.locator('#menu nav a[href="/datasets"]').isVisible(), `${name}: the navigation is folded at 1280 px`);
  }
  await shoot(name, 1280, desktopShotHeight);
  await page.setViewportSize(PHONE);
  await page.emulateMedia({ colorScheme: 'dark' });
  browser.noErrorsSoFar();
}

let datasetId;
let jobId;
// GPUs the server has (the CPU aside): what its pages should say it trains on.
let gpuCount = 0;
const JOB_NAME = 'layout run';

/** Histogram ranges that do not fit their column, by their text: none may be cut off. */
function cutRanges() {
  return page.evaluate(() => [...document.querySelectorAll('.histogram .range')]
    .filter((r) => r.scrollWidth > r.clientWidth + 1 || r.scrollHeight > r.clientHeight + 1)
    .map((r) => `${r.textContent} (${r.scrollWidth}×${r.scrollHeight} in ${r.clientWidth}×${r.clientHeight})`));
}

test('every page on a phone in dark mode, and at 1280 px', { timeout: 8 * 60_000 }, async (context) => {
  // The steps depend on each other: after the first failure the rest are skipped.
  let failed = false;
  const t = {
    test: (name, fn) => context.test(name, { skip: failed && 'an earlier step failed' }, async (sub) => {
      try {
        await fn(sub);
      } catch (err) {
        failed = true;
        throw err;
      }
    }),
  };
  await t.test('setup', async () => {
    await page.goto(url('/'));
    await page.waitForURL(/\/setup$/);
    await checkPage('setup', { ready: () => page.waitForSelector('#setup-form'), nav: false, focusTarget: '#setup-form button[type=submit]' });
    await page.fill('#username', ADMIN.username);
    await page.fill('#password', ADMIN.password);
    await page.fill('#password2', ADMIN.password);
    await page.click('button[type=submit]');
    await page.waitForURL(url('/'));
    await page.waitForSelector(`#who-name:has-text("${ADMIN.username}")`, { state: 'attached' });
  });

  await t.test('datasets and a dataset preview', async () => {
    await page.goto(url('/datasets'));
    const row = page.locator('#datasets-table tbody tr').first();
    await row.waitFor();
    datasetId = Number(await row.getAttribute('data-dataset'));
    await checkPage('datasets', { ready: () => page.waitForSelector('#datasets-table') });
    await page.goto(url(`/datasets/${datasetId}`));
    await checkPage('dataset', {
      ready: async () => {
        await page.waitForSelector('.sample .trained');
        await page.waitForSelector('.histogram > div');
        // Every length range reads whole (a narrow column breaks it after its dash).
        assert.deepEqual(await cutRanges(), [], 'histogram labels cut off');
      },
    });
    gpuCount = (await (await page.request.get(url('/api/gpus'))).json()).filter((d) => d.id !== 'cpu').length;
  });

  await t.test('new job, with the plan between the form and Start', async () => {
    await page.goto(url(`/jobs/new?dataset=${datasetId}`));
    const fill = async () => {
      await page.waitForSelector('#model option[value="preset:tiny"]', { state: 'attached' });
      await page.selectOption('#model', 'preset:tiny');
      await page.check('input[name="gpu"][value="cpu"]');
      // A rate far above the band for random weights of this size is warned about, in the
      // field's words; a rate out of bounds is refused once, by its label, not the engine's name.
      await page.fill('#lr', '0.5');
      await page.locator('#lr-warning').waitFor({ state: 'visible' });
      assert.match(await page.locator('#lr-warning').innerText(), /^Learning rate 0\.5 is high/);
      await page.fill('#lr', '1000000');
      await page.waitForSelector('#plan-card[data-state="ready"] #plan-error');
      assert.match(await page.locator('#plan-error').innerText(), /^Learning rate must be above 0 and at most 1\b/);
      await page.click('#submit');
      assert.equal(await page.evaluate(() => document.activeElement?.id), 'lr', 'Start does not lead to the field');
      assert.ok(await page.locator('#submit-error').isHidden(), 'the refusal is said twice');
      const said = await page.evaluate(() => document.body.innerText.split(/\bLearning rate must be\b/).length - 1);
      assert.equal(said, 1, 'the refusal is said once');
      assert.ok(await page.locator('#lr-warning').isHidden(), 'a refused rate is also warned about');
      await page.fill('#lr', '');
      await page.locator('#lr-warning').waitFor({ state: 'hidden' });
      await page.fill('#name', JOB_NAME);
      await page.fill('#steps', '10');
      await page.fill('#seq_len', '64');
      // Held-out loss every 5 steps, and before the first.
      await page.click('#advanced > summary');
      await page.fill('#eval_every', '5');
      await page.waitForSelector('#plan-card[data-state="ready"]');
      await page.waitForSelector('#plan-fits[data-fits="true"]');
      // The verdict, the time and the memory show; the engineering folds behind "Details".
      assert.ok(await page.locator('[data-plan="step_time"]').isVisible());
      assert.ok(await page.locator('#plan .tier .bar').first().isVisible());
      assert.equal(await page.locator('#plan-details').getAttribute('open'), null, 'the details start unfolded');
      assert.ok(await page.locator('#plan-gradients').isHidden(), 'the gradient table shows unasked');
      // On the processor, nothing in the card speaks of a GPU.
      if (gpuCount === 0) {
        // (Advice to try a GPU for a slow run is fine.)
        const text = await page.locator('#plan-card').evaluate((n) => n.textContent.replace(/try a GPU/g, ''));
        assert.doesNotMatch(text, /GPU/, `the plan card of a CPU job: ${text}`);
      }
    };
    await checkPage('new-job', { ready: fill });
    // On a phone the form, then the verdict, then Start, one under the other.
    await page.reload();
    await fill();
    const box = async (sel) => page.locator(sel).boundingBox();
    const [form, plan, start] = [await box('#job-form'), await box('#plan-card'), await box('#submit')];
    assert.ok(form.y + form.height <= plan.y + 1 && plan.y + plan.height <= start.y + 1,
      `on a phone the plan is not between the form and Start: form ${JSON.stringify(form)}, plan ${JSON.stringify(plan)}, start ${JSON.stringify(start)}`);
    // Start still submits the form it sits outside of.
    await page.click('#submit');
    await page.waitForURL(/\/jobs\/\d+$/);
    jobId = Number(new URL(page.url()).pathname.split('/').pop());
  });

  await t.test('a finished CPU job, without GPU-only charts', async () => {
    await page.waitForSelector('#status .badge[data-status="completed"]', { timeout: 120_000 });
    const ready = async () => {
      await page.waitForSelector('#status .badge[data-status="completed"]');
      await page.waitForSelector('[data-chart="loss"] canvas');
      // The held-out loss before training is the eval chart's first point (step 0), and the
      // eval figure says where it came from.
      await page.waitForSelector('[data-chart="loss"][data-first-step="0"]');
      assert.match(await page.locator('[data-fact="eval_loss"] .v').innerText(), /^\d[\d.]* \(from \d[\d.]*\)$/);
      // Ten steps and no save_every: the run saved every 2 steps, and says so.
      assert.match(await page.locator('#settings [data-setting="save_every"] dd').innerText(), /^2 steps\b/);
      assert.equal(await page.locator('[data-fact="final_loss"] .k').innerText().then((t) => t.toLowerCase()), 'final loss');
      // A timeline, where the device reports one, names the lanes after this job's device.
      const lanes = await page.locator('#timeline [data-lane]').allInnerTexts();
      if (gpuCount === 0) assert.ok(!lanes.some((l) => /GPU/.test(l)), `a CPU job's timeline: ${lanes}`);
    };
    await checkPage('job', { ready });
    const charts = await page.locator('#charts [data-chart]').evaluateAll((nodes) => nodes.map((n) => n.dataset.chart));
    assert.ok(charts.includes('loss') && charts.includes('host_mem'), `charts: ${charts}`);
    assert.ok(!charts.includes('gpu_mem') && !charts.includes('pcie'), `a CPU job shows GPU-only charts: ${charts}`);
    // Axes say what they count: "step" along x, the unit up y (sizes in one binary unit).
    assert.match(await page.getAttribute('[data-chart="host_mem"]', 'data-axes'), /^step\|(KiB|MiB|GiB)$/);
    assert.match(await page.getAttribute('[data-chart="loss"]', 'data-axes'), /^step\|loss$/);
    // Long labels too: a chart of large, close values (drawn beside the page's own).
    await page.evaluate(async () => {
      const { MetricChart } = await import('/static/js/charts.js');
      const chart = new MetricChart(document.querySelector('#charts'), {
        key: 'wide', title: 'Wide', unit: 'tokens/s', series: [{ field: 'v', label: 'v' }], format: String,
      });
      chart.update([1, 2, 3, 4].map((step) => ({ step, v: 1_234_567.25 + step * 0.75 })));
    });
    await page.waitForSelector('[data-chart="wide"][data-y-ticks]');
    // No digit is cut: the y axis (drawn on a canvas) is wider than its widest tick label.
    const cut = await page.evaluate(() => {
      const ctx = document.createElement('canvas').getContext('2d');
      ctx.font = '11px system-ui, sans-serif';
      const out = [];
      for (const chart of document.querySelectorAll('#charts .chart[data-y-ticks]')) {
        const axis = chart.querySelectorAll('.u-axis')[1];
        const widest = Math.max(...chart.dataset.yTicks.split('|').map((l) => ctx.measureText(l).width));
        // The label column (16 px) and the tick marks (10 px) share the axis with the numbers.
        if (widest + 26 > axis.getBoundingClientRect().width) out.push(`${chart.dataset.chart}: ${chart.dataset.yTicks} in ${axis.getBoundingClientRect().width} px`);
      }
      return out;
    });
    assert.deepEqual(cut, [], 'y axes too narrow for their labels');
  });

  await t.test('dashboard, models, users', async () => {
    await page.goto(url('/'));
    await checkPage('dashboard', {
      ready: async () => {
        await page.waitForSelector(`#jobs-table tr[data-job="${jobId}"]`);
        await page.waitForSelector('#gpus .gpu');
        // The job's name is its link, and every column has a heading.
        const link = page.locator(`#jobs-table tr[data-job="${jobId}"] a[href="/jobs/${jobId}"]`);
        assert.match(await link.innerText(), new RegExp(`^${JOB_NAME}\\s+#${jobId}$`));
        const heads = await page.locator('#jobs-table thead th').allTextContents();
        assert.ok(heads.includes('Time left'), `headings: ${heads.join(' | ')}`);
      },
    });
    // On a phone the table is a list: each row a block inside the card, each cell named by its column.
    await page.setViewportSize(PHONE);
    await page.reload();
    await page.waitForSelector(`#jobs-table tr[data-job="${jobId}"]`);
    const row = await page.evaluate((id) => {
      const tr = document.querySelector(`#jobs-table tr[data-job="${id}"]`);
      const card = tr.closest('.card').getBoundingClientRect();
      return {
        display: getComputedStyle(tr).display,
        inside: tr.getBoundingClientRect().right <= card.right,
        labels: [...tr.cells].map((td) => td.dataset.label),
        shown: getComputedStyle(tr.cells[2], '::before').content,
      };
    }, jobId);
    assert.equal(row.display, 'flex', 'the jobs table is not a list on a phone');
    assert.ok(row.inside, 'a job row reaches past its card');
    assert.deepEqual(row.labels.slice(0, 4), ['Compare', 'Job', 'Model', 'Dataset']);
    assert.ok(row.labels.includes('Time left'), `cells named: ${row.labels.join(' | ')}`);
    assert.equal(row.shown, '"Model"', 'the model cell does not say it is the model');

    // The open menu, as the keyboard leaves it.
    await page.focus('#menu-button');
    await page.keyboard.press('Enter');
    await page.locator('#menu nav a[href="/models"]').waitFor({ state: 'visible' });
    await page.keyboard.press('Tab');
    await browser.screenshot('menu-390');
    await page.keyboard.press('Escape');

    await page.goto(url('/models'));
    // The models table is a long list of dense rows (every preset): its top is what the
    // screenshot needs, and the full 1800 px of rows outgrows the screenshots' size limit.
    await checkPage('models', { ready: () => page.waitForSelector('#models-table'), desktopShotHeight: 1200 });
    // A second account, so the page offers "Set password", whose form is checked open.
    await page.evaluate(async () => {
      const { post } = await import('/static/js/api.js');
      await post('/api/users', { username: 'lin', password: 'a long enough password' });
    });
    await page.goto(url('/admin/users'));
    await checkPage('users', {
      ready: async () => {
        await page.click('#users-table tr[data-user="lin"] button:has-text("Set password")');
        await page.waitForSelector('#reset-form:not([hidden])');
      },
    });
  });

  await t.test('account, storage, and two jobs compared', async () => {
    await page.goto(url('/account'));
    await checkPage('account', {
      ready: () => page.waitForFunction(() => !document.querySelector('#tokens').textContent.includes('Loading')),
    });
    await page.goto(url('/admin/storage'));
    await checkPage('storage', {
      ready: async () => {
        await page.waitForSelector('#storage-table');
        await page.waitForFunction(() => !document.querySelector('#storage-models').textContent.includes('Loading'));
      },
    });
    // A second, shorter job through the page's own API helper, to compare with the first.
    const secondJobId = await page.evaluate(async (dataset) => {
      const { post } = await import('/static/js/api.js');
      const created = await post('/api/jobs', { model: 'preset:tiny', dataset, gpu: 'cpu', steps: 2, seq_len: 64, name: 'shorter run' });
      return created.id;
    }, datasetId);
    await page.goto(url(`/jobs/${secondJobId}`));
    await page.waitForSelector('#status .badge[data-status="completed"]', { timeout: 120_000 });
    await page.goto(url(`/jobs/compare?ids=${jobId},${secondJobId}`));
    await checkPage('compare', {
      ready: async () => {
        await page.waitForSelector('#settings-table');
        await page.waitForSelector('#results-table');
        await page.waitForSelector('#compare-charts canvas');
      },
    });
  });

  await t.test('login, reached through the menu', async () => {
    await page.setViewportSize(PHONE);
    await page.click('#menu-button');
    await page.click('#logout');
    await page.waitForURL(/\/login/);
    await checkPage('login', {
      ready: async () => {
        await page.waitForSelector('#login-form');
        // What the server trains on, as it is: no GPU words on a machine without one.
        const says = await page.locator('#trains-on').innerText();
        assert.match(says, gpuCount === 0 ? /processor/ : /GPU/, says);
        if (gpuCount === 0) assert.doesNotMatch(says, /GPU/, says);
      },
      nav: false,
      focusTarget: '#login-form button[type=submit]',
    });
  });
});
