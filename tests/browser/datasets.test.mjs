// Datasets as people have them, in a real browser: a lenient upload of a file with bad records
// (the skipped lines listed, the count kept, the same on the dataset's page) and a CSV upload
// whose columns are mapped on the page, a LLaMA-Factory file with its dataset_info.json, and a
// delete that says what it freed.
import assert from 'node:assert/strict';
import { mkdtempSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { after, before, test } from 'node:test';

import { openBrowser, setupAdmin } from './harness.mjs';
import { repoRoot, startServer } from './server.mjs';

const ADMIN = { username: 'dora', password: 'datasets are data too' };

let server;
let browser;
let page;
const dir = mkdtempSync(path.join(tmpdir(), 'sluice-datasets-'));

before(async () => {
  server = await startServer();
  browser = await openBrowser();
  ({ page } = browser);
  await setupAdmin(page, server.url, ADMIN);
});

after(async () => {
  if (browser) await browser.close();
  if (server) await server.stop();
});

const url = (p) => `${server.url}${p}`;

test('a lenient upload lists the skipped lines and keeps the rest', async () => {
  const file = path.join(dir, 'chats.jsonl');
  writeFileSync(file, [
    '{"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}]}',
    '{"conversations": [{"from": "human", "value": "cut off"',
    '{"conversations": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"}]}',
    '{"conversations": [{"from": "bing", "value": "odd"}, {"from": "gpt", "value": "?"}]}',
    '{"conversations": [{"from": "human", "value": "Bye"}, {"from": "gpt", "value": "Bye."}]}',
    '',
  ].join('\n'));
  await page.goto(url('/datasets'));
  await page.setInputFiles('#file', file);
  await page.click('#upload-button');
  // Strict first: refused, every bad line named, nothing kept.
  const refused = page.locator('#upload-error');
  await refused.waitFor({ state: 'visible' });
  assert.match(await refused.innerText(), /2 bad records[\s\S]*line 2[\s\S]*line 4/);

  await page.check('#skip-invalid');
  await page.setInputFiles('#file', file);
  await page.click('#upload-button');
  const ok = page.locator('#upload-ok');
  await ok.waitFor({ state: 'visible' });
  const text = await ok.innerText();
  assert.match(text, /3 examples kept/);
  assert.match(text, /2 invalid records were skipped/);
  assert.match(text, /line 2: not valid JSON/);
  assert.match(text, /line 4: message 1: unknown role "bing"/);
  assert.equal(await page.locator('#upload-skipped li').count(), 2);

  await ok.locator('a[href^="/datasets/"]').click();
  await page.waitForSelector('#skipped-card:not([hidden])');
  assert.match(await page.locator('#skipped-note').innerText(), /2 invalid records were skipped[\s\S]*3 are kept/);
  assert.equal(await page.locator('#skipped li').count(), 2);
  assert.match(await page.locator('#subtitle').innerText(), /sharegpt · JSONL · 3 examples · 2 skipped/);
  // The preview says what rendered it: a preset falls back to the built-in tokenizer.
  await page.waitForSelector('#samples pre.sample');
  assert.match(await page.locator('#rendered-with').innerText(), /built-in tiny tokenizer/);
  await browser.screenshot('dataset-lenient');
  browser.noErrorsSoFar();
});

test('a CSV upload maps its columns on the page', async () => {
  const file = path.join(dir, 'trivia.csv');
  writeFileSync(file, 'id,ask,reply\n1,Capital of France?,Paris.\n2,"Largest planet, by mass?",Jupiter.\n');
  await page.goto(url('/datasets'));
  await page.setInputFiles('#file', file);
  // The header is read in the browser: a select per field, no column guessed for these names.
  await page.waitForSelector('#columns-box:not([hidden])');
  assert.equal(await page.inputValue('#column-instruction'), '');
  await page.selectOption('#column-instruction', 'ask');
  await page.selectOption('#column-output', 'reply');
  await browser.screenshot('datasets-columns');
  await page.click('#upload-button');
  const ok = page.locator('#upload-ok');
  await ok.waitFor({ state: 'visible' });
  assert.match(await ok.innerText(), /2 examples kept/);
  assert.ok(await page.locator('#columns-box').isHidden(), 'the mapping is cleared after the upload');
  await ok.locator('a[href^="/datasets/"]').click();
  await page.waitForSelector('#samples pre.sample');
  assert.match(await page.locator('#subtitle').innerText(), /alpaca · CSV · 2 examples[\s\S]*columns: instruction ← ask, output ← reply/);
  assert.match(await page.locator('#samples').innerText(), /Largest planet, by mass\?[\s\S]*Jupiter\./);
  assert.ok(await page.locator('#skipped-card').isHidden());
  browser.noErrorsSoFar();
});

test('a LLaMA-Factory file uploads with its dataset_info.json, and a delete says what it freed', async () => {
  const examples = path.join(repoRoot, 'datasets', 'examples');
  await page.goto(url('/datasets'));
  await page.setInputFiles('#file', path.join(examples, 'openai-tags.jsonl'));
  await page.click('#registry-box summary');
  await page.setInputFiles('#dataset-info', path.join(examples, 'dataset_info.json'));
  await browser.screenshot('datasets-registry');
  await page.click('#upload-button');
  const ok = page.locator('#upload-ok');
  await ok.waitFor({ state: 'visible' });
  assert.match(await ok.innerText(), /1 example kept/);
  await ok.locator('a[href^="/datasets/"]').click();
  await page.waitForSelector('#samples pre.sample');
  assert.match(await page.locator('#subtitle').innerText(), /dataset_info\.json entry “custom_tags_example”/);
  assert.match(await page.locator('#samples').innerText(), /Answer with the sum\.[\s\S]*2 \+ 2 = 4\./);

  // Deleted from its own page: the list then says how much disk came back.
  page.once('dialog', (dialog) => dialog.accept());
  await page.click('#delete');
  await page.waitForURL(url('/datasets'));
  const notice = page.locator('#notice');
  await notice.waitFor({ state: 'visible' });
  assert.match(await notice.innerText(), /^Deleted “openai-tags\.jsonl”: \d+(\.\d+)? (B|KiB) freed\.$/);
  browser.noErrorsSoFar();
});
