// Runs one can find, compare and clean up, in the browser: a named job and its summary, "run
// again" with its settings, two jobs compared, a job deleted with the disk it freed, and the
// storage page. The steps depend on each other and run in order.
import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';

import path from 'node:path';

import { openBrowser, setupAdmin } from './harness.mjs';
import { repoRoot, startServer } from './server.mjs';

const ADMIN = { username: 'ada', password: 'correct horse battery' };
const STEPS = 6;

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

async function waitCompleted() {
  await page.waitForSelector('#status .badge[data-status="completed"]', { timeout: 240_000 });
}

const jobIdOfPage = () => Number(new URL(page.url()).pathname.split('/').pop());

/** Submits a job through the page's own API helper; its id. */
function submit(body) {
  return page.evaluate(async (b) => {
    const { post } = await import('/static/js/api.js');
    return (await post('/api/jobs', b)).id;
  }, body);
}

/** Polls job `id` until `done(job)` holds; the job. */
async function waitJob(id, done, seconds = 240) {
  const deadline = Date.now() + seconds * 1000;
  for (;;) {
    const job = JSON.parse((await api(`/api/jobs/${id}`)).body);
    if (done(job)) return job;
    if (Date.now() > deadline) assert.fail(`job ${id} did not get there: ${JSON.stringify(job)}`);
    await page.waitForTimeout(200);
  }
}

/** `GET path` from the page, with its session: `{status, body}`. */
async function api(path) {
  return page.evaluate(async (p) => {
    const response = await fetch(p);
    return { status: response.status, body: await response.text() };
  }, path);
}

test('runs', async (t) => {
  const ids = [];

  await t.test('a job is named in the form and its page opens with a summary', async () => {
    await setupAdmin(page, server.url, ADMIN);
    await page.goto(url('/jobs/new'));
    await page.waitForSelector('#model option[value="preset:tiny"]', { state: 'attached' });
    await page.selectOption('#model', 'preset:tiny');
    await page.check('input[name="gpu"][value="cpu"]');
    await page.fill('#name', 'baseline');
    await page.fill('#note', 'the demo as it comes');
    await page.fill('#steps', String(STEPS));
    await page.fill('#seq_len', '32');
    await page.waitForSelector('#plan-fits[data-fits="true"]');
    await page.click('#submit');
    await page.waitForURL(/\/jobs\/\d+$/);
    ids.push(jobIdOfPage());
    await page.waitForSelector('#title:has-text("baseline")');
    await waitCompleted();
    // The summary fills in from the job as it ends.
    await page.waitForFunction(() => document.querySelector('[data-fact="final_loss"] .v')?.textContent !== '—');
    const fact = (key) => page.locator(`#run-summary [data-fact="${key}"] .v`).innerText();
    assert.match(await fact('final_loss'), /^\d+(\.\d+)?$/);
    assert.match(await fact('best_loss'), /^\d+(\.\d+)? \(step \d+\)$/);
    assert.match(await fact('tokens_seen'), /^[\d,]+$/);
    assert.match(await fact('throughput'), /tok\/s$/);
    assert.notEqual(await fact('started'), '—');
    assert.notEqual(await fact('finished'), '—');
    assert.notEqual(await fact('duration'), '—');
    assert.match(await page.locator('#run-settings-line').innerText(), new RegExp(`${STEPS} steps`));
    assert.equal(await page.inputValue('#job-note'), 'the demo as it comes');

    // Renamed on its page.
    await page.fill('#job-name', 'baseline v1');
    await page.click('#save-label');
    await page.waitForSelector('#title:has-text("baseline v1")');
    const job = JSON.parse((await api(`/api/jobs/${ids[0]}`)).body);
    assert.equal(job.name, 'baseline v1');
    browser.noErrorsSoFar();
  });

  await t.test('"run again" opens the form with the job\'s settings', async () => {
    await page.click('#run-again');
    await page.waitForURL(/\/jobs\/new\?from=\d+$/);
    await page.waitForFunction(() => document.querySelector('#name').value !== '');
    assert.equal(await page.inputValue('#name'), 'baseline v1 (again)');
    assert.equal(await page.inputValue('#steps'), String(STEPS));
    assert.equal(await page.inputValue('#seq_len'), '32');
    assert.equal(await page.inputValue('#model'), 'preset:tiny');
    assert.ok(await page.isChecked('input[name="gpu"][value="cpu"]'));
    assert.equal(await page.getAttribute('#presets button[data-preset="custom"]', 'aria-pressed'), 'true');
    // One change, to compare against.
    await page.fill('#lr', '0.005');
    await page.fill('#name', 'faster lr');
    await page.waitForSelector('#plan-fits[data-fits="true"]');
    await page.click('#submit');
    await page.waitForURL(/\/jobs\/\d+$/);
    ids.push(jobIdOfPage());
    await waitCompleted();
    browser.noErrorsSoFar();
  });

  await t.test('two jobs ticked on the dashboard are compared', async () => {
    await page.goto(url('/'));
    for (const id of ids) await page.check(`input[data-compare="${id}"]`);
    await page.click('#compare');
    await page.waitForURL(/\/jobs\/compare\?ids=/);
    await page.waitForSelector('#settings-table');
    const points = Number(await page.getAttribute('[data-chart="loss"]', 'data-points'));
    assert.ok(points >= STEPS, `the loss chart draws ${points} points`);
    assert.equal(await page.getAttribute('#settings-table tr[data-setting="lr"]', 'data-differs'), 'true');
    assert.equal(await page.getAttribute('#settings-table tr[data-setting="steps"]', 'data-differs'), 'false');
    assert.equal(await page.getAttribute('#settings-table tr[data-setting="seq_len"]', 'data-differs'), 'false');
    // (Headings are shown in capitals: compare the words, not the case.)
    const heads = (await page.locator('#settings-table thead th').allInnerTexts()).map((h) => h.toLowerCase());
    assert.ok(heads.some((h) => h.includes('baseline v1')) && heads.some((h) => h.includes('faster lr')), heads.join(' | '));
    assert.match(await page.locator('#diff-count').innerText(), /rows differ/);
    await browser.screenshot('compare');
    browser.noErrorsSoFar();
  });

  await t.test('the live chart misses no point when its event stream opens late', async () => {
    // The page used to read the history at the same time as it asked for the stream: when the
    // history came first, a point stored between the two was never shown (the live chart
    // stopped one short of the run). Here the stream is held back 3 s while the job runs.
    const steps = 120;
    const { dataset } = JSON.parse((await api(`/api/jobs/${ids[0]}`)).body);
    const id = await submit({ model: 'preset:tiny', dataset, gpu: 'cpu', steps, seq_len: 32, micro_batch: 1, name: 'late stream' });
    await waitJob(id, (j) => j.status === 'running' && j.step >= 2);
    const late = async (route) => {
      await new Promise((resolve) => { setTimeout(resolve, 3000); });
      await route.continue().catch(() => {});
    };
    await page.route('**/api/jobs/*/events', late);
    try {
      await page.goto(url(`/jobs/${id}`));
      await waitCompleted();
      const drawn = () => page.getAttribute('[data-chart="loss"]', 'data-points').then(Number);
      await page.waitForFunction((n) => Number(document.querySelector('[data-chart="loss"]')?.dataset.points) === n, steps, { timeout: 15_000 })
        .catch(async () => assert.fail(`the live chart drew ${await drawn()} of ${steps} points`));
    } finally {
      await page.unroute('**/api/jobs/*/events', late);
    }
    browser.noErrorsSoFar();
  });

  await t.test('a job is deleted, and the page says what it freed', async () => {
    const [first] = ids;
    await page.goto(url(`/jobs/${first}`));
    await waitCompleted();
    const button = page.locator('#delete-job');
    await button.waitFor();
    const label = await button.innerText();
    const frees = /frees (\S+ \S+)\)$/.exec(label);
    assert.ok(frees, label);
    page.once('dialog', (dialog) => {
      assert.match(dialog.message(), new RegExp(`frees ${frees[1].replace('.', '\\.')}`));
      dialog.accept();
    });
    await button.click();
    await page.waitForSelector('#notice:has-text("deleted")');
    assert.match(await page.locator('#notice').innerText(), new RegExp(`Job #${first} deleted: ${frees[1].replace('.', '\\.')} freed`));
    // Nothing of the deleted job is offered any more: no status badge, no "Run again".
    assert.equal(await page.locator('#status .badge').count(), 0, 'the deleted job keeps its badge');
    assert.ok(await page.locator('#run-again').isHidden(), 'the deleted job offers "Run again"');
    assert.match(await page.locator('#title').innerText(), /deleted/);
    assert.equal((await api(`/api/jobs/${first}`)).status, 404);
    await page.goto(url('/'));
    await page.waitForSelector(`#jobs-table tr[data-job="${ids[1]}"]`);
    assert.equal(await page.locator(`#jobs-table tr[data-job="${first}"]`).count(), 0);
    browser.noErrorsSoFar();
  });

  await t.test('deleting a dataset names the stopped jobs that lose their resume', async () => {
    await page.goto(url('/datasets'));
    await page.waitForSelector('#datasets table, #datasets .empty');
    await page.setInputFiles('#file', path.join(repoRoot, 'datasets', 'demo-alpaca.jsonl'));
    await page.fill('#name', 'short-lived');
    await page.click('#upload-button');
    const link = page.locator('#upload-ok a[href^="/datasets/"]');
    await link.waitFor();
    const dataset = Number((await link.getAttribute('href')).split('/').pop());
    // A long job on it, stopped part-way: resumable while the dataset exists.
    const id = await submit({ model: 'preset:tiny', dataset, gpu: 'cpu', steps: 100_000, seq_len: 32, name: 'to resume' });
    await waitJob(id, (j) => j.status === 'running' && j.step >= 1);
    await page.evaluate(async (job) => {
      const { post } = await import('/static/js/api.js');
      await post(`/api/jobs/${job}/cancel`);
    }, id);
    await waitJob(id, (j) => j.status === 'cancelled');
    await page.goto(url(`/jobs/${id}`));
    await page.locator('#resume').waitFor({ state: 'visible' });

    await page.goto(url('/datasets'));
    const row = page.locator(`#datasets-table tr[data-dataset="${dataset}"]`);
    await row.waitFor();
    let asked = '';
    page.once('dialog', (dialog) => {
      asked = dialog.message();
      dialog.accept();
    });
    await row.locator('button.danger').click();
    await page.waitForSelector('#notice:has-text("short-lived")');
    assert.match(asked, new RegExp(`to resume \\(#${id}\\) can no longer be resumed`), asked);

    // The job's page no longer offers Resume, and says why.
    await page.goto(url(`/jobs/${id}`));
    await page.locator('#resume-note').waitFor({ state: 'visible' });
    assert.match(await page.locator('#resume-note').innerText(), /dataset was deleted/);
    assert.ok(await page.locator('#resume').isHidden(), 'Resume is still offered');
    browser.noErrorsSoFar();
  });

  await t.test('the storage page shows each account\'s disk and takes a quota', async () => {
    await page.goto(url('/admin/storage'));
    await page.waitForSelector('#storage-table tr[data-user="ada"]');
    const total = await page.locator('#storage-table [data-total="ada"]').innerText();
    assert.match(total, /\d/);
    await page.fill('input[data-quota="ada"]', '0');
    await page.click('button[data-save-quota="ada"]');
    await page.waitForSelector('#notice:has-text("may use up to")');
    await page.waitForSelector('#storage-table [data-total="ada"]:has-text("over quota")');
    await browser.screenshot('storage');
    // Over the quota, a new job is refused with the reason.
    await page.goto(url(`/jobs/new?from=${ids[1]}`));
    await page.waitForFunction(() => document.querySelector('#name').value !== '');
    await page.waitForSelector('#plan-fits[data-fits="true"]');
    await page.click('#submit');
    await page.waitForSelector('#submit-error:has-text("storage quota")');
    browser.noErrorsSoFar();
  });
});
