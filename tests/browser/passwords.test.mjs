// Passwords, as people change them: an administrator sets a new password for someone from the
// Users page (their sessions end at once), and that person changes it again on their account
// page, giving the current one (their other sessions end, the one they use stays). Bad input is
// shown in the form as the server words it.
import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';

import { openBrowser, setupAdmin } from './harness.mjs';
import { startServer } from './server.mjs';

const ADMIN = { username: 'hedy', password: 'correct horse battery' };
const USER = { username: 'ada', first: 'first password', reset: 'set by the admin', own: 'chosen by ada herself' };

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

/** A session of `username`'s opened from a script, as another browser would: its cookie. */
async function loginElsewhere(username, password) {
  const anonymous = await fetch(url('/api/session'));
  const nonce = anonymous.headers.get('set-cookie').split(';')[0];
  const { csrf } = await anonymous.json();
  const reply = await fetch(url('/api/login'), {
    method: 'POST',
    headers: { Cookie: nonce, 'X-CSRF-Token': csrf, 'Content-Type': 'application/json' },
    body: JSON.stringify({ username, password }),
  });
  assert.equal(reply.status, 200, await reply.text());
  return reply.headers.get('set-cookie').split(';')[0];
}

/** Who the session behind `cookie` belongs to now (null once it has ended). */
async function whoIs(cookie) {
  const reply = await fetch(url('/api/session'), { headers: { Cookie: cookie } });
  return (await reply.json()).user?.username ?? null;
}

test('an admin resets a password and its owner changes it', { timeout: 3 * 60_000 }, async (t) => {
  let adaElsewhere;

  await t.test('the admin sets a new password from the Users page', async () => {
    await setupAdmin(page, server.url, ADMIN);
    await page.goto(url('/admin/users'));
    assert.match(await page.innerText('#user-form .hint'), /can change it on their account page/);
    await page.fill('#new-username', USER.username);
    await page.fill('#new-password', USER.first);
    await page.click('#user-form button[type=submit]');
    const row = page.locator(`#users-table tr[data-user="${USER.username}"]`);
    await row.waitFor();
    adaElsewhere = await loginElsewhere(USER.username, USER.first);
    assert.equal(await whoIs(adaElsewhere), USER.username);

    await row.locator('button:has-text("Set password")').click();
    await page.waitForSelector('#reset-form:not([hidden])');
    assert.equal(await page.textContent('#reset-name'), USER.username);
    await page.fill('#reset-password', 'short');
    await page.click('#reset-form button[type=submit]');
    await page.waitForSelector('#reset-error:not([hidden])');
    assert.match(await page.textContent('#reset-error'), /at least 8 characters/);
    assert.equal(await whoIs(adaElsewhere), USER.username, 'a refused reset ends nothing');

    await page.fill('#reset-password', USER.reset);
    await page.click('#reset-form button[type=submit]');
    await page.waitForSelector('#reset-done:not([hidden])');
    assert.match(await page.textContent('#reset-done'), /ada has a new password/);
    assert.ok(await page.isHidden('#reset-form'));
    assert.equal(await whoIs(adaElsewhere), null, 'her sessions ended');
    // The admin's own row offers the account page instead.
    const mine = page.locator(`#users-table tr[data-user="${ADMIN.username}"] a:has-text("Change password")`);
    assert.equal(await mine.getAttribute('href'), '/account');
    browser.noErrorsSoFar();
  });

  await t.test('the owner changes it on the account page; her other sessions end', async () => {
    await page.click('#who-name');
    await page.waitForURL(url('/account'));
    await page.click('#logout');
    await page.waitForURL(/\/login/);
    await page.fill('#username', USER.username);
    await page.fill('#password', USER.reset);
    await page.click('button[type=submit]');
    await page.waitForSelector(`#who-name:has-text("${USER.username}")`);
    adaElsewhere = await loginElsewhere(USER.username, USER.reset);
    await page.goto(url('/account'));
    await page.waitForSelector('#password-form');

    await page.fill('#current-password', 'not her password');
    await page.fill('#new-password', USER.own);
    await page.fill('#new-password2', USER.own);
    await page.click('#password-form button[type=submit]');
    await page.waitForSelector('#password-error:not([hidden])');
    assert.equal(await page.textContent('#password-error'), 'the current password is wrong');

    await page.fill('#current-password', USER.reset);
    await page.fill('#new-password2', 'something else');
    await page.click('#password-form button[type=submit]');
    await page.waitForSelector('#password-error:has-text("differ")');

    await page.fill('#new-password2', USER.own);
    await page.click('#password-form button[type=submit]');
    await page.waitForSelector('#password-ok:not([hidden])');
    assert.ok(await page.isHidden('#password-error'));
    assert.equal(await page.inputValue('#current-password'), '', 'the form is cleared');
    assert.equal(await whoIs(adaElsewhere), null, 'her other session ended');
    await page.reload();
    await page.waitForSelector(`#who-name:has-text("${USER.username}")`);
    assert.equal(new URL(page.url()).pathname, '/account', 'this session stays');

    // The new password is the one that works now.
    await loginElsewhere(USER.username, USER.own);
    browser.noErrorsSoFar();
  });
});
