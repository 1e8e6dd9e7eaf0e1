// Task evaluation in the browser: the new-job form shows what a metric will compare (and
// refuses a set that does not suit it), a job that learns its task's fixed answer charts its
// metric against the base model's line and lists the base model's answers beside the tuned
// ones, the compare page sets two runs' figures side by side, and "try it" answers one
// conversation with the base model and the checkpoint side by side. The steps depend on each
// other and run in order.
import assert from 'node:assert/strict';
import { cpSync, mkdirSync } from 'node:fs';
import path from 'node:path';
import { after, before, test } from 'node:test';

import { openBrowser, setupAdmin } from './harness.mjs';
import { startServer } from './server.mjs';

const ADMIN = { username: 'ada', password: 'correct horse battery' };
const WORDS = ['river', 'stone', 'cloud', 'maple', 'amber', 'north', 'quiet', 'lemon'];
// Record 64, held out of training, carries markup: the pages must show it as text.
const MARKUP = '<b>quiet</b> lemon <img src=x onerror="window.__injected=1"> 63: reply';

/**
 * 64 requests whose answer is always `answer` (as engine/tests/task_eval.rs): a random-init
 * model does not say it, one trained on them for 40 steps does.
 */
function fixedAnswers(answer) {
  return Array.from({ length: 64 }, (_, i) => JSON.stringify({
    instruction: i === 63 ? MARKUP : `${WORDS[i % 8]} ${WORDS[Math.floor(i / 8) % 8]} ${i}: reply`,
    input: '',
    output: answer,
  })).join('\n');
}

// The job's settings beside the form's: an exact-match evaluation of the last eighth.
const SETTINGS = { steps: 40, seq_len: 64, micro_batch: 4, lr: 1e-2, eval_every: 20, held_out: 0.125, eval_metric: 'exact_match', eval_max_new_tokens: 4 };

let server;
let browser;
let page;

before(async () => {
  server = await startServer();
  browser = await openBrowser();
  ({ page } = browser);
});

after(async () => {
  if (browser) await browser.close();
  if (server) await server.stop();
});

const url = (p) => `${server.url}${p}`;
const jobIdOfPage = () => Number(new URL(page.url()).pathname.split('/').pop());

/** Uploads a dataset through the page's own API helper; its id. */
function upload(name, text) {
  return page.evaluate(async ({ name: file, text: body }) => {
    const { upload: send } = await import('/static/js/api.js');
    const form = new FormData();
    form.append('file', new Blob([body], { type: 'application/octet-stream' }), file);
    return (await send('/api/datasets', form, () => {})).id;
  }, { name, text });
}

/** Submits a job through the page's own API helper; its id. */
function submit(body) {
  return page.evaluate(async (b) => {
    const { post } = await import('/static/js/api.js');
    return (await post('/api/jobs', b)).id;
  }, body);
}

/** `GET path` from the page, with its session, as JSON. */
function api(p) {
  return page.evaluate(async (where) => (await fetch(where)).json(), p);
}

async function waitJob(id, seconds = 240) {
  const deadline = Date.now() + seconds * 1000;
  for (;;) {
    const job = await api(`/api/jobs/${id}`);
    if (['completed', 'failed', 'cancelled', 'interrupted'].includes(job.status)) {
      assert.equal(job.status, 'completed', `job ${id}: ${job.error}`);
      return job;
    }
    if (Date.now() > deadline) assert.fail(`job ${id} did not end: ${JSON.stringify(job)}`);
    await page.waitForTimeout(250);
  }
}

/** Saves `docs/screenshots/<name>.png`, the part of the page `selector` covers. */
async function shoot(name, selector) {
  const part = page.locator(selector);
  await part.scrollIntoViewIfNeeded();
  await browser.screenshot(name, { clip: await part.boundingBox() });
}

test('task evaluation', async (t) => {
  const ids = {};
  let okData;

  await t.test('the new-job form shows a sample of what the metric compares', async () => {
    await setupAdmin(page, server.url, ADMIN);
    okData = await upload('says-ok.jsonl', fixedAnswers('ok'));
    await page.goto(url(`/jobs/new?dataset=${okData}`));
    await page.waitForSelector('#model option[value="preset:tiny"]', { state: 'attached' });
    await page.selectOption('#model', 'preset:tiny');
    await page.check('input[name="gpu"][value="cpu"]');
    await page.fill('#name', 'says ok');
    for (const key of ['steps', 'seq_len', 'micro_batch', 'lr']) await page.fill(`#${key}`, String(SETTINGS[key]));
    // The metric starts at the engine's default, the loss only: nothing is compared.
    assert.equal(await page.inputValue('#eval_metric'), 'loss');
    assert.ok(await page.locator('#eval-sample').isHidden());
    assert.equal(await page.inputValue('#eval_dataset'), '');
    await page.fill('#held_out', String(SETTINGS.held_out));

    await page.selectOption('#eval_metric', 'exact_match');
    assert.match(await page.locator('#eval_metric-hint').innerText(), /must equal the reference/);
    await page.waitForSelector('#eval-sample[data-state="ready"]');
    const sample = page.locator('#eval-sample');
    assert.match(await sample.innerText(), /the first 3 of 8 records/);
    const first = sample.locator('li[data-line="57"]');
    assert.equal(await first.locator('.prompt').innerText(), 'river lemon 56: reply');
    assert.equal(await first.locator('.reference').innerText(), 'ok');

    // The answer format and its pattern show only where they apply.
    assert.ok(await page.locator('#eval_answer').isHidden());
    await page.selectOption('#eval_metric', 'extract');
    await page.waitForSelector('#eval_answer', { state: 'visible' });
    assert.ok(await page.locator('#eval_pattern').isHidden());
    await page.selectOption('#eval_answer', 'regex');
    await page.waitForSelector('#eval_pattern', { state: 'visible' });
    await page.fill('#eval_pattern', 'answer: (\\w+)');

    // A set that does not suit the metric says why, and the job does not start.
    await page.selectOption('#eval_metric', 'choice');
    assert.ok(await page.locator('#eval_answer').isHidden());
    await page.waitForSelector('#eval-sample[data-state="error"]');
    assert.match(await page.locator('#eval-sample-error').innerText(), /needs an evaluation dataset whose records have `choices`/);
    assert.equal(await page.getAttribute('#eval_metric', 'aria-invalid'), 'true');
    await page.waitForSelector('#plan-card[data-state="ready"]');
    await page.click('#submit');
    await page.waitForSelector('#submit-error:not([hidden])');
    assert.match(await page.locator('#submit-error').innerText(), /cannot run on this data/);
    assert.match(page.url(), /\/jobs\/new/);

    await page.selectOption('#eval_metric', 'exact_match');
    await page.waitForSelector('#eval-sample[data-state="ready"]');
    assert.equal(await page.getAttribute('#eval_metric', 'aria-invalid'), null);
    await shoot('eval-new-job', '#evaluation');
    await page.click('#advanced > summary');
    await page.fill('#eval_every', String(SETTINGS.eval_every));
    await page.fill('#eval_max_new_tokens', String(SETTINGS.eval_max_new_tokens));
    await page.waitForSelector('#plan-card[data-state="ready"] #plan-fits[data-fits="true"]');
    await page.click('#submit');
    await page.waitForURL(/\/jobs\/\d+$/);
    ids.ok = jobIdOfPage();
    // What the form sent is what the job runs with: the pattern of a metric left was not sent.
    const job = await api(`/api/jobs/${ids.ok}`);
    for (const [key, value] of Object.entries(SETTINGS)) assert.equal(job.config[key], value, key);
    assert.equal(job.config.eval_pattern, null);
    assert.equal(job.config.eval_answer, 'last_number');
    browser.noErrorsSoFar();
  });

  await t.test('the job charts its metric over the base model and lists the answers', async () => {
    await page.waitForSelector('#status .badge[data-status="completed"]', { timeout: 240_000 });
    const chart = page.locator('[data-chart="task_score"]');
    await page.waitForFunction(() => Number(document.querySelector('[data-chart="task_score"]')?.dataset.points) === 3);
    assert.equal(await chart.getAttribute('data-first-step'), '0');
    assert.equal(await chart.getAttribute('data-baseline'), '0', 'the base model says "ok" to none');
    assert.match(await chart.locator('h3').innerText(), /Exact match/);
    // The legend names the base model's line.
    assert.match(await chart.innerText(), /base model/);
    const summary = await page.locator('#summary [data-fact="task_score"] .v').innerText();
    assert.match(summary, /^0 → (0\.\d+|1)$/);
    const after = Number(summary.split('→')[1]);
    assert.ok(after >= 0.75, `exact match after training: ${after}`);
    await page.waitForFunction(() => document.querySelector('#run-summary [data-fact="summary_task"] .v')?.textContent.includes('step 40'));
    assert.match(await page.locator('#run-summary [data-fact="summary_task"] .v').innerText(), /^0 → .* \(step 40\)$/);

    // Every held-out record, with both answers: the last evaluation's once it is in.
    await page.waitForFunction(() => /\(step 40\)/.test(document.querySelector('#answers-figures')?.textContent || ''));
    const rows = page.locator('#answers-table tbody tr');
    assert.equal(await rows.count(), 8);
    assert.match(await page.locator('#answers-figures').innerText(), /Exact match: 0 \(base model\) → .* \(step 40\)/);
    const texts = (cls) => page.locator(`#answers-table tbody td.${cls}`).allInnerTexts();
    assert.deepEqual(await texts('reference'), Array(8).fill('ok'));
    const tuned = await texts('tuned-answer');
    assert.ok(tuned.filter((a) => a === 'ok').length >= 6, `tuned answers: ${tuned.join(' | ')}`);
    const base = await texts('base-answer');
    assert.ok(base.every((a) => a !== 'ok'), `base answers: ${base.join(' | ')}`);

    // Sorted by change or by line.
    const order = async (value) => {
      await page.selectOption('#answers-order', value);
      return page.locator('#answers-table tbody tr').evaluateAll((trs) => trs.map((tr) => [Number(tr.dataset.line), tr.dataset.change]));
    };
    const rank = { better: 0, same: 1, worse: 2 };
    const byLine = await order('line');
    assert.deepEqual(byLine.map(([line]) => line), [57, 58, 59, 60, 61, 62, 63, 64]);
    const better = (await order('better')).map(([, c]) => rank[c]);
    assert.deepEqual(better, [...better].sort(), 'got better first');
    assert.equal(better[0], 0);
    const worse = (await order('worse')).map(([, c]) => rank[c]);
    assert.deepEqual(worse, [...worse].sort().reverse(), 'got worse first');

    // Model output and data are text, never markup.
    const marked = page.locator('#answers-table tbody tr[data-line="64"] td.prompt');
    assert.equal(await marked.innerText(), MARKUP);
    assert.equal(await page.locator('#answers-table b, #answers-table img').count(), 0);
    assert.equal(await page.evaluate(() => window.__injected), undefined);

    await shoot('eval-chart', '[data-chart="task_score"]');
    await shoot('eval-answers', '#answers-card');
    browser.noErrorsSoFar();
  });

  await t.test('the compare page sets two runs\' figures side by side', async () => {
    ids.short = await submit({ model: 'preset:tiny', dataset: okData, gpu: 'cpu', name: 'says ok, 20 steps', ...SETTINGS, steps: 20, eval_every: 10 });
    await waitJob(ids.short);
    await page.goto(url(`/jobs/compare?ids=${ids.ok},${ids.short}`));
    await page.waitForSelector('#results-table');
    const figures = {};
    for (const id of [ids.ok, ids.short]) {
      assert.equal(await page.locator(`#results-table tr[data-result="eval_metric"] td[data-job="${id}"]`).innerText(), 'Exact match');
      figures[id] = await page.locator(`#results-table tr[data-result="task"] td[data-job="${id}"]`).innerText();
      assert.match(figures[id], /^0 → (0|0\.\d+|1)$/);
    }
    // Each run's own figure: the job page's summary said the same for the longer one.
    const job = await api(`/api/jobs/${ids.ok}`);
    assert.equal(figures[ids.ok], `0 → ${Number(job.summary.task_score.toPrecision(4))}`);
    const points = Number(await page.getAttribute('[data-chart="task_score"]', 'data-points'));
    assert.equal(points, 4, 'steps 0, 10, 20 and 40: the two runs\' evaluations by step');
    browser.noErrorsSoFar();
  });

  await t.test('try it answers with the base model beside the checkpoint', async () => {
    // A preset's job has no base model folder.
    await page.goto(url(`/jobs/${ids.ok}`));
    await page.waitForSelector('#try:not([hidden])');
    assert.ok(await page.locator('#try-base').isDisabled());
    assert.match(await page.locator('#try-base-hint').innerText(), /Unavailable: .*random weights/);

    // The model that learnt to say "ok" becomes a model folder, and a job teaches it "no".
    mkdirSync(path.join(server.dataDir, 'models'), { recursive: true });
    cpSync(path.join(server.dataDir, 'runs', String(ids.ok), 'final'), path.join(server.dataDir, 'models', 'says-ok'), { recursive: true });
    const noData = await upload('says-no.jsonl', fixedAnswers('no'));
    ids.no = await submit({ model: 'local:says-ok', dataset: noData, gpu: 'cpu', name: 'says no', ...SETTINGS });
    await waitJob(ids.no);
    await page.goto(url(`/jobs/${ids.no}`));
    await page.waitForSelector('#try:not([hidden])');
    assert.ok(await page.locator('#try-base').isEnabled());
    assert.match(await page.locator('#try-base-hint').innerText(), /says-ok/);
    await page.check('#try-base');
    await page.click('#try-options > summary');
    await page.fill('#try-tokens', '4');

    const exchange = async (message, send) => {
      await page.fill('#try-message', message);
      await send();
      const pair = page.locator('#try-conversation .pair').last();
      await pair.locator('.turn[data-model="base"][data-state="done"]').waitFor({ timeout: 60_000 });
      await pair.locator('.turn[data-model="checkpoint"][data-state="done"]').waitFor();
      const text = (model) => pair.locator(`.turn[data-model="${model}"] .body`).innerText();
      return { base: await text('base'), tuned: await text('checkpoint') };
    };
    const first = await exchange('amber north 9: reply', () => page.press('#try-message', 'Enter'));
    assert.match(first.base, /\bok\b/, `the base model said ${first.base}`);
    assert.match(first.tuned, /\bno\b/, `the checkpoint said ${first.tuned}`);
    assert.match(await page.locator('.pair .turn[data-model="checkpoint"] .role').last().innerText(), /checkpoint final/i);
    // The second message goes with each model's own history, and both answer it.
    const second = await exchange('lemon cloud 70: reply', () => page.click('#try-send'));
    assert.match(second.base, /\bok\b/);
    assert.match(second.tuned, /\bno\b/);
    assert.equal(await page.locator('#try-conversation .turn.user').count(), 2);
    assert.equal(await page.locator('#try-conversation .pair').count(), 2);
    assert.ok(await page.locator('#try-error').isHidden());
    await shoot('eval-try-base', '#try');

    // Turned off, the checkpoint answers alone again, in a new conversation.
    await page.uncheck('#try-base');
    assert.equal(await page.locator('#try-conversation .turn').count(), 0);
    await page.fill('#try-message', 'amber north 9: reply');
    await page.press('#try-message', 'Enter');
    await page.waitForSelector('#try-conversation .turn.model[data-state="done"]');
    assert.equal(await page.locator('#try-conversation .pair').count(), 0);
    browser.noErrorsSoFar();
  });
});
