// Models by name in the browser: the real SmolLM2-135M-Instruct (its GGUF imported by
// `sluice import-gguf`) served by a local stand-in for the Hugging Face Hub, pulled through the
// models page, listed, and offered by the new-job form.
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { existsSync, mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { after, before, test } from 'node:test';

import { openBrowser, setupAdmin } from './harness.mjs';
import { startHub } from './hub_server.mjs';
import { repoRoot, startServer } from './server.mjs';

const GGUF = path.join(repoRoot, '.cache', 'test-assets', 'smollm2', 'SmolLM2-135M-Instruct.Q4_1.gguf');
const REPO = 'HuggingFaceTB/SmolLM2-135M-Instruct';
const COMMIT = '4e3a1b2c'.repeat(5);
const MODEL_ID = `hf:${REPO}@main`;
const ADMIN = { username: 'ada', password: 'correct horse battery' };

let work;
let hub;
let server;
let browser;
let page;

before(async () => {
  assert.ok(existsSync(GGUF), `${GGUF} is missing: run scripts/fetch_test_assets.sh`);
  work = mkdtempSync(path.join(tmpdir(), 'sluice-hub-'));
  const folder = path.join(work, 'smollm2');
  const binary = process.env.SLUICE_BIN || path.join(repoRoot, 'target', 'release', 'sluice');
  const imported = spawnSync(binary, ['import-gguf', GGUF, '--out', folder], { encoding: 'utf8' });
  assert.equal(imported.status, 0, imported.stderr);
  hub = await startHub({ [REPO]: { dir: folder, commit: COMMIT } });
  // The server pulls from the stand-in, and reads no Hugging Face cache of this machine.
  process.env.HF_ENDPOINT = hub.url;
  process.env.HF_HUB_CACHE = path.join(work, 'empty-cache');
  delete process.env.HF_TOKEN;
  server = await startServer();
  browser = await openBrowser();
  ({ page } = browser);
});

after(async () => {
  if (browser) await browser.close();
  if (server) await server.stop();
  if (hub) await hub.stop();
  if (work) rmSync(work, { recursive: true, force: true });
});

const url = (p) => `${server.url}${p}`;

test('a model pulled by name on the models page is listed and offered for training', async () => {
  await setupAdmin(page, server.url, ADMIN);
  await page.goto(url('/models'));
  await page.waitForSelector('#models-table');
  const preset = await page.textContent('tr[data-model="preset:tiny"]');
  assert.match(preset, /random weights.*for trying the appliance, not for real use/);
  assert.equal(await page.locator(`tr[data-model="${MODEL_ID}"]`).count(), 0);

  // A name the Hub does not know says so and starts nothing.
  await page.fill('#pull-repo', 'HuggingFaceTB/no-such-model');
  await page.click('#pull-button');
  await page.waitForSelector('#pull-error:not([hidden])');
  assert.match(await page.textContent('#pull-error'), /no model HuggingFaceTB\/no-such-model/);

  await page.fill('#pull-repo', REPO);
  await page.click('#pull-button');
  await page.waitForSelector(`.pull[data-repo="${REPO}"]`);
  assert.equal(await page.isHidden('#pull-error'), true);
  await page.waitForSelector(`.pull[data-repo="${REPO}"][data-state="done"]`, { timeout: 180_000 });
  const row = page.locator(`tr[data-model="${MODEL_ID}"]`);
  await row.waitFor();
  assert.match(await row.textContent(), /Pulled from the Hub/);
  assert.match(await row.textContent(), /llama/);
  assert.match(await page.textContent(`.pull[data-repo="${REPO}"]`), new RegExp(`Listed as ${MODEL_ID}`));
  // The window around the pulled model's row: the whole page grows with every preset.
  await row.scrollIntoViewIfNeeded();
  await browser.screenshot('models');

  await row.locator('a', { hasText: 'Train' }).click();
  await page.waitForURL(/\/jobs\/new/);
  await page.waitForFunction((id) => document.querySelector('#model')?.value === id, MODEL_ID);
  browser.noErrorsSoFar();
});

test('the pulled model is deleted from the storage page, which says what it freed', async () => {
  const name = `hf:${REPO}`;
  await page.goto(url('/admin/storage'));
  const row = page.locator(`#models-table tr[data-model="${name}"]`);
  await row.waitFor();
  assert.match(await row.textContent(), /pulled from the Hub/);
  const button = row.locator('button', { hasText: 'Delete' });
  const frees = /frees (\S+ \S+)\)$/.exec(await button.innerText());
  assert.ok(frees, await button.innerText());
  page.once('dialog', (dialog) => dialog.accept());
  await button.click();
  const notice = page.locator('#notice');
  await notice.waitFor({ state: 'visible' });
  assert.equal(await notice.innerText(), `Deleted ${name}: ${frees[1]} freed.`);
  await row.waitFor({ state: 'detached' });
  await page.goto(url('/models'));
  await page.waitForSelector('#models-table');
  assert.equal(await page.locator(`tr[data-model="${MODEL_ID}"]`).count(), 0, 'the deleted model is still listed');
  browser.noErrorsSoFar();
});
