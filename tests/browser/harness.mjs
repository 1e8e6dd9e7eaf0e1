// What every browser test file shares: a headless Chromium on a fresh profile, watching for script
// errors and requests that leave the appliance; screenshots under docs/screenshots; the first
// administrator's setup.
import assert from 'node:assert/strict';
import { mkdirSync, mkdtempSync, rmSync, statSync } from 'node:fs';
import { tmpdir } from 'node:os';
import path from 'node:path';

import { chromium } from 'playwright-core';

import { repoRoot } from './server.mjs';

const CHROMIUM = process.env.CHROMIUM || '/usr/bin/chromium';
export const SHOTS = path.join(repoRoot, 'docs', 'screenshots');

/**
 * Launches Chromium with a fresh profile. `options` may set `viewport` and `colorScheme`.
 * Returns { context, page, noErrorsSoFar(), screenshot(name, opts), close() }.
 */
export async function openBrowser(options = {}) {
  const profileDir = mkdtempSync(path.join(tmpdir(), 'sluice-chromium-'));
  const context = await chromium.launchPersistentContext(profileDir, {
    executablePath: CHROMIUM,
    headless: true,
    args: ['--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
      '--disable-background-networking', '--disable-component-update', '--disable-sync'],
    viewport: options.viewport || { width: 1280, height: 860 },
    deviceScaleFactor: 1,
    acceptDownloads: true,
    colorScheme: options.colorScheme || 'light',
  });
  context.setDefaultTimeout(20_000);
  const pageErrors = [];
  const outsideRequests = [];
  context.on('request', (request) => {
    const url = new URL(request.url());
    if (!['127.0.0.1', 'localhost'].includes(url.hostname) && url.protocol.startsWith('http')) outsideRequests.push(request.url());
  });
  const page = context.pages()[0] || (await context.newPage());
  page.on('pageerror', (err) => pageErrors.push(`${page.url()}: ${err.message}`));
  page.on('console', (message) => {
    if (message.type() === 'error' && /Content Security Policy|SyntaxError|TypeError|ReferenceError/.test(message.text())) {
      pageErrors.push(`${page.url()}: ${message.text()}`);
    }
  });
  mkdirSync(SHOTS, { recursive: true });
  return {
    context,
    page,
    noErrorsSoFar() {
      assert.deepEqual(pageErrors, [], 'the pages raised script errors');
      assert.deepEqual(outsideRequests, [], 'the pages fetched something outside the appliance');
    },
    async screenshot(name, opts = {}) {
      const file = path.join(SHOTS, `${name}.png`);
      await page.screenshot({ path: file, ...opts });
      const size = statSync(file).size;
      assert.ok(size < 300 * 1024, `${name}.png is ${size} bytes; keep screenshots under 300 KB`);
    },
    async close() {
      await context.close();
      rmSync(profileDir, { recursive: true, force: true });
    },
  };
}

/** On a fresh server, creates the administrator through the setup page; they are then logged in. */
export async function setupAdmin(page, baseUrl, admin) {
  await page.goto(`${baseUrl}/`);
  await page.waitForURL(/\/setup$/);
  await page.fill('#username', admin.username);
  await page.fill('#password', admin.password);
  await page.fill('#password2', admin.password);
  await page.click('button[type=submit]');
  await page.waitForURL(`${baseUrl}/`);
  await page.waitForSelector(`#who-name:has-text("${admin.username}")`);
}
