// The demo link in the browser: the owner turns it on from the job page, a visitor with no
// account opens it and sees the live figures and the step's timeline, and once the owner turns
// it off the same link opens nothing.
import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';

import { openBrowser, setupAdmin } from './harness.mjs';
import { startServer } from './server.mjs';

const ADMIN = { username: 'ada', password: 'correct horse battery' };

let server;
let owner;
let visitor;

before(async () => {
  server = await startServer();
  owner = await openBrowser();
  visitor = await openBrowser({ colorScheme: 'dark' });
});

after(async () => {
  for (const b of [owner, visitor]) if (b) await b.close();
  if (server) await server.stop();
});

test('a demo link is turned on, opened without an account, and turned off', { timeout: 5 * 60_000 }, async () => {
  const { page } = owner;
  await setupAdmin(page, server.url, ADMIN);
  await page.goto(`${server.url}/jobs/new`);
  await page.waitForSelector('#model option[value="preset:tiny"]', { state: 'attached' });
  await page.selectOption('#model', 'preset:tiny');
  await page.check('input[name="gpu"][value="cpu"]');
  await page.fill('#name', 'on the big screen');
  await page.fill('#steps', '4');
  await page.fill('#seq_len', '32');
  await page.waitForSelector('#plan-fits[data-fits="true"]');
  await page.click('#submit');
  await page.waitForURL(/\/jobs\/\d+$/);
  await page.waitForSelector('#status .badge[data-status="completed"]', { timeout: 240_000 });

  await page.click('#demo-on');
  const link = page.locator('#demo-link');
  await link.waitFor({ state: 'visible' });
  const href = await link.getAttribute('href');
  assert.match(href, /^\/demo\/[0-9a-f]{64}$/);
  assert.equal(await page.locator('#demo-on').isHidden(), true);

  const view = visitor.page;
  await view.goto(`${server.url}${href}`);
  await view.waitForSelector('#demo-title:has-text("on the big screen")');
  const figure = (key) => view.locator(`.demo-figure[data-key="${key}"] .demo-value`).innerText();
  assert.match(await figure('params'), /^\d+(\.\d+)? [MB]$/);
  // A CPU job: no GPU memory or PCIe figures.
  assert.equal(await view.locator('.demo-figure[data-key="h2d"]').count(), 0);
  assert.match(await figure('tokens_per_s'), /^[\d,]+$/);
  assert.match(await figure('loss'), /^\d+(\.\d+)?$/);
  assert.match(await view.locator('#demo-step').innerText(), /step 4 of 4/);
  // The last step's timeline, one bar per unit's work on each stream.
  await view.waitForSelector('#demo-timeline .lane span');
  assert.ok((await view.locator('#demo-timeline .lane span').count()) >= 6);
  // The visitor's browser holds no session: the job's own page would send it to log in.
  const jobId = new URL(page.url()).pathname.split('/').pop();
  const own = await view.evaluate(async (p) => (await fetch(p)).status, `/api/jobs/${jobId}`);
  assert.equal(own, 401);
  await visitor.screenshot('demo-1280');

  await page.click('#demo-off');
  await page.locator('#demo-on').waitFor({ state: 'visible' });
  await view.reload();
  await view.waitForSelector('#demo-closed:not([hidden])');
  assert.match(await view.locator('#demo-closed').innerText(), /off/);
  visitor.noErrorsSoFar();
  owner.noErrorsSoFar();
});
