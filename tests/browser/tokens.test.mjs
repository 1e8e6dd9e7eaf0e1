// Scripts and operators, as a person would set them up: an API token made on the account page
// and used from Node with fetch (no cookie, no CSRF token), a webhook set on the same page and
// received by a local HTTP server when a job ends, the job's start and end in the server's log,
// and the token revoked in the page, after which it is refused.
import assert from 'node:assert/strict';
import http from 'node:http';
import { after, before, test } from 'node:test';

import { openBrowser, setupAdmin } from './harness.mjs';
import { startServer } from './server.mjs';

const ADMIN = { username: 'tess', password: 'correct horse battery' };

let server;
let browser;
let page;
let receiver;
const hooks = [];
let hookArrived = () => {};

before(async () => {
  // The receiver listens on loopback, which webhooks may reach only where the operator says so.
  server = await startServer({ configToml: 'webhook_private_hosts = ["127.0.0.1"]\n' });
  browser = await openBrowser();
  ({ page } = browser);
  receiver = http.createServer((request, response) => {
    let body = '';
    request.setEncoding('utf8');
    request.on('data', (chunk) => { body += chunk; });
    request.on('end', () => {
      hooks.push({ headers: request.headers, body: JSON.parse(body) });
      hookArrived();
      response.writeHead(204).end();
    });
  });
  await new Promise((resolve) => receiver.listen(0, '127.0.0.1', resolve));
});

after(async () => {
  if (receiver) await new Promise((resolve) => receiver.close(resolve));
  if (browser) await browser.close();
  if (server) await server.stop();
});

const url = (p) => `${server.url}${p}`;

/** A request from a script: the token and nothing else. */
function withToken(token, path, options = {}) {
  const headers = { Authorization: `Bearer ${token}`, ...(options.body ? { 'Content-Type': 'application/json' } : {}) };
  return fetch(url(path), { ...options, headers, body: options.body ? JSON.stringify(options.body) : undefined });
}

/** Resolves once `count` webhook posts have arrived (at most `ms`). */
function hooksArrived(count, ms) {
  return new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`${hooks.length} webhook posts after ${ms} ms`)), ms);
    const check = () => {
      if (hooks.length >= count) {
        clearTimeout(timer);
        resolve();
      }
    };
    hookArrived = check;
    check();
  });
}

let token;

test('API tokens and a webhook, from the account page', { timeout: 5 * 60_000 }, async (t) => {
  await t.test('the account page is reached from the name in the top bar', async () => {
    await setupAdmin(page, server.url, ADMIN);
    await page.click('#who-name');
    await page.waitForURL(url('/account'));
    // Drawn by the page's script, once it has asked the API.
    await page.waitForSelector('#tokens .empty:has-text("No tokens yet.")');
    await page.waitForSelector('#webhook-last:has-text("No webhook")');
    assert.equal(await page.getAttribute('#who-name', 'aria-current'), 'page');
    browser.noErrorsSoFar();
  });

  await t.test('a token is made and shown once', async () => {
    await page.fill('#token-name', 'nightly script');
    await page.click('#token-form button[type=submit]');
    await page.waitForSelector('#new-token:not([hidden])');
    token = (await page.textContent('#new-token-value')).trim();
    assert.match(token, /^sluice_[0-9a-f]{64}$/);
    const row = page.locator('#tokens-table tr[data-token="nightly script"]');
    await row.waitFor();
    const text = await row.innerText();
    assert.match(text, /never/);
    assert.ok(text.includes(token.slice(0, 15)) && !text.includes(token.slice(15)), text);
    await browser.screenshot('account');
    // Shown once: a reload lists the token without it.
    await page.reload();
    await page.locator('#tokens-table tr[data-token="nightly script"]').waitFor();
    assert.equal(await page.isVisible('#new-token'), false);
    assert.ok(!(await page.content()).includes(token), 'the page shows the token again');
    browser.noErrorsSoFar();
  });

  await t.test('a webhook is set on the same page', async () => {
    const address = receiver.address();
    await page.fill('#webhook-url', `http://127.0.0.1:${address.port}/hook`);
    await page.click('#webhook-form button[type=submit]');
    await page.waitForSelector('#webhook-ok:not([hidden])');
    await page.click('#webhook-test');
    await page.waitForSelector('#webhook-status[data-ok="true"]');
    assert.match(await page.textContent('#webhook-last'), /a test.*delivered/);
    assert.equal(hooks.length, 1);
    assert.equal(hooks[0].body.event, 'test');
    browser.noErrorsSoFar();
  });

  await t.test('a script uses the token with fetch: no cookie, no CSRF token', async () => {
    const me = await withToken(token, '/api/jobs');
    assert.equal(me.status, 200, await me.text());
    const datasets = await (await withToken(token, '/api/datasets')).json();
    const demo = datasets.find((d) => d.name === 'demo-alpaca');
    assert.ok(demo, JSON.stringify(datasets));
    const submitted = await withToken(token, '/api/jobs', {
      method: 'POST',
      body: { model: 'preset:tiny', dataset: demo.id, gpu: 'cpu', steps: 3, seq_len: 64, micro_batch: 1 },
    });
    const answer = await submitted.text();
    assert.equal(submitted.status, 201, answer);
    const { id } = JSON.parse(answer);
    // The same write from a browser-like request without the CSRF header is refused.
    const forged = await fetch(url('/api/jobs'), { method: 'POST', headers: { 'Content-Type': 'application/json' }, body: '{}' });
    assert.equal(forged.status, 403);

    await hooksArrived(2, 120_000);
    const ended = hooks[1].body;
    assert.equal(ended.id, id);
    assert.equal(ended.status, 'completed');
    assert.equal(ended.url, url(`/jobs/${id}`));
    assert.equal(typeof ended.final_loss, 'number');
    assert.equal(hooks[1].headers['content-type'], 'application/json');
    // The operator's view: the start and the end in the server's log, with who and what.
    const log = server.log();
    assert.match(log, new RegExp(`job ${id} started.*user=${ADMIN.username}.*model=preset:tiny.*device=cpu`));
    assert.match(log, new RegExp(`job ${id} completed.*duration=.*final_loss=`));

    // The page shows the token's use and the delivery.
    await page.reload();
    const row = page.locator('#tokens-table tr[data-token="nightly script"]');
    await row.waitFor();
    assert.doesNotMatch(await row.locator('[data-last-used]').innerText(), /never/);
    await page.waitForSelector('#webhook-status[data-ok="true"]');
    assert.match(await page.textContent('#webhook-last'), new RegExp(`job ${id}.*delivered`));
    browser.noErrorsSoFar();
  });

  await t.test('revoked in the page, the token is refused at once', async () => {
    page.once('dialog', (dialog) => dialog.accept());
    await page.click('#tokens-table tr[data-token="nightly script"] button');
    await page.waitForSelector('#tokens .empty:has-text("No tokens yet.")');
    const refused = await withToken(token, '/api/jobs');
    assert.equal(refused.status, 401);
    assert.match((await refused.json()).error, /API token/);
    browser.noErrorsSoFar();
  });
});
