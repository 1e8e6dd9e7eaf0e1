// End to end, as a person would use the appliance: headless Chromium against the release binary.
// The steps depend on each other and run in order; the first failure stops the rest.
import assert from 'node:assert/strict';
import { readFileSync, writeFileSync } from 'node:fs';
import path from 'node:path';
import { after, before, test } from 'node:test';

import { openBrowser, setupAdmin } from './harness.mjs';
import { repoRoot, startServer } from './server.mjs';
import { tarMembers } from './tar.mjs';

const DEMO = path.join(repoRoot, 'datasets', 'demo-alpaca.jsonl');
const STEPS = 30;
const SAVE_EVERY = 15;
const ADMIN = { username: 'ada', password: 'correct horse battery' };
const OTHER = { username: 'bob', password: 'another long password' };

let server;
let browser;
let page;
const existsShot = { running: false };

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
const screenshot = (name, options) => browser.screenshot(name, options);

/** How many points a chart draws (the page keeps it in data-points). */
async function chartPoints(key) {
  return Number(await page.getAttribute(`[data-chart="${key}"]`, 'data-points'));
}

/** The events of a whole server-sent events body, read apart from the page's own parser. */
function sseEvents(body) {
  const events = [];
  for (const frame of body.split(/\r\n\r\n|\n\n|\r\r/)) {
    let name = 'message';
    const data = [];
    for (const line of frame.split(/\r\n|\n|\r/)) {
      if (!line || line.startsWith(':')) continue;
      const [, field, value] = /^([^:]*):? ?(.*)$/s.exec(line);
      if (field === 'event') name = value;
      else if (field === 'data') data.push(value);
    }
    if (data.length) events.push({ name, data: JSON.parse(data.join('\n')) });
  }
  return events;
}

/**
 * The events the page's parser (`sseParser` in api.js) reads from `body` when it arrives cut in
 * two at `cut`, for each cut; they must be the same wherever the cut falls.
 */
function pageParsesAtEveryCut(body) {
  return page.evaluate(async (text) => {
    const { sseParser } = await import('/static/js/api.js');
    const read = (pieces) => {
      const events = [];
      const parser = sseParser((name, data) => events.push({ name, data: JSON.parse(data) }));
      for (const piece of pieces) parser.push(piece);
      parser.end();
      return JSON.stringify(events);
    };
    const whole = read([text]);
    for (let cut = 1; cut < text.length; cut += 1) {
      if (read([text.slice(0, cut), text.slice(cut)]) !== whole) return { cut, whole };
    }
    return { cut: null, whole };
  }, body);
}

/**
 * `text` as Playwright hands back the body of a response with this Content-Type: Chromium decodes
 * a text body that names no charset as windows-1252 (the page itself reads the stream as UTF-8).
 * Decoded in the browser, whose TextDecoder knows windows-1252 (Node's may only know latin-1).
 */
function asPlaywrightReads(text, contentType) {
  if (/charset\s*=\s*"?utf-8/i.test(contentType)) return text;
  return page.evaluate((t) => new TextDecoder('windows-1252').decode(new TextEncoder().encode(t)), text);
}

function noErrorsSoFar() {
  browser.noErrorsSoFar();
}

let datasetId;
let jobId;
let checkpointName;

test('the appliance, end to end', { timeout: 8 * 60_000 }, async (t) => {
  await t.test('a fresh server asks for the administrator, who is then logged in', async () => {
    await setupAdmin(page, server.url, ADMIN);
    await page.waitForSelector('nav a[href="/admin/users"]:visible');
    noErrorsSoFar();
  });

  await t.test('upload the demo dataset', async () => {
    await page.click('nav a[href="/datasets"]');
    await page.waitForSelector('#datasets table, #datasets .empty');
    await page.setInputFiles('#file', DEMO);
    await page.fill('#name', 'my upload');
    await page.click('#upload-button');
    const link = page.locator('#upload-ok a[href^="/datasets/"]');
    await link.waitFor();
    datasetId = Number((await link.getAttribute('href')).split('/').pop());
    assert.ok(Number.isInteger(datasetId) && datasetId > 0, `dataset id ${datasetId}`);
    const row = page.locator(`#datasets-table tr[data-dataset="${datasetId}"]`);
    await row.waitFor();
    assert.match(await row.innerText(), /my upload[\s\S]*1,000/);
    noErrorsSoFar();
  });

  await t.test('a malformed dataset is refused with its line numbers', async () => {
    const rows = await page.locator('#datasets-table tbody tr').count();
    const bad = path.join(server.dataDir, 'bad.jsonl');
    const good = readFileSync(DEMO, 'utf8').split('\n')[0];
    writeFileSync(bad, `${good}\n{"instruction": "no output"\n${good}\n`);
    await page.setInputFiles('#file', bad);
    await page.click('#upload-button');
    const alert = page.locator('#upload-error');
    await alert.waitFor({ state: 'visible' });
    assert.match(await alert.innerText(), /line 2/);
    await page.reload();
    await page.waitForSelector('#datasets-table');
    assert.equal(await page.locator('#datasets-table tbody tr').count(), rows, 'the refused file was kept');
  });

  await t.test('the preview shows trained tokens, statistics and a histogram', async () => {
    await page.click(`#datasets-table tr[data-dataset="${datasetId}"] td:first-child a`);
    await page.waitForURL(url(`/datasets/${datasetId}`));
    await page.waitForSelector('.sample .trained');
    await page.waitForSelector('.histogram > div');
    assert.ok(await page.locator('.sample').count() >= 1);
    const tokens = await page.locator('[data-stat="tokens"] .v').innerText();
    assert.ok(Number(tokens.replace(/,/g, '')) > 0, `tokens: ${tokens}`);
    await screenshot('dataset-preview');
    // One example longer than the sequence length is one example, in the singular.
    const oneLong = path.join(server.dataDir, 'one-long.jsonl');
    const long = Array.from({ length: 600 }, (_, i) => `word${i % 97} and more`).join(' ');
    writeFileSync(oneLong, `${JSON.stringify({ instruction: 'Say hi.', input: '', output: 'Hi.' })}\n${JSON.stringify({ instruction: 'Tell a long story.', input: '', output: long })}\n`);
    await page.goto(url('/datasets'));
    await page.setInputFiles('#file', oneLong);
    await page.click('#upload-button');
    const longLink = page.locator('#upload-ok a[href^="/datasets/"]');
    await longLink.waitFor();
    await page.goto(url(await longLink.getAttribute('href')));
    await page.waitForSelector('.histogram > div');
    await page.waitForFunction(() => document.querySelector('#stats-notes')?.textContent.includes('longer than'));
    assert.match(await page.locator('#stats-notes').innerText(), /\b1 example is longer than [\s\S]* and loses its end\b/);
    noErrorsSoFar();
  });

  await t.test('the new-job page shows the plan, and a job starts on the tiny preset', async () => {
    // Before any job the form starts from the shared demo, not from the newest upload.
    await page.goto(url('/jobs/new'));
    await page.waitForSelector(`#dataset option[value="${datasetId}"]`, { state: 'attached' });
    const shared = (await (await page.request.get(url('/api/datasets'))).json()).find((d) => d.owner === null);
    assert.equal(await page.inputValue('#dataset'), String(shared.id), 'the form does not start from the demo');
    await page.goto(url(`/jobs/new?dataset=${datasetId}`));
    await page.waitForSelector('#model option[value="preset:tiny"]', { state: 'attached' });
    await page.selectOption('#model', 'preset:tiny');
    await page.check('input[name="gpu"][value="cpu"]');
    await page.click('#presets button[data-preset="demo"]');
    await page.fill('#steps', String(STEPS));
    await page.fill('#seq_len', '128');
    // The rest is folded away until asked for; checkpoints default to bf16.
    assert.ok(await page.locator('#save_dtype').isHidden(), 'the advanced settings start folded');
    await page.click('#advanced > summary');
    assert.equal(await page.inputValue('#save_dtype'), 'bf16');
    await page.selectOption('#save_dtype', 'f32');
    await page.fill('#save_every', String(SAVE_EVERY));
    // The card re-plans with the same body the job is submitted with; wait for that answer.
    await page.waitForSelector('#plan-card[data-state="ready"]');
    const refused = page.locator('#plan-error');
    if (await refused.count()) assert.fail(`the plan answered an error: ${await refused.innerText()}`);
    await page.waitForSelector('#plan-fits[data-fits="true"]');
    await page.waitForSelector('.tier .bar');
    // The placement and the gradient policies are folded behind "Details" until asked for.
    assert.ok(await page.locator('#plan-gradients').isHidden(), 'the gradient table shows unasked');
    await page.click('#plan-details > summary');
    assert.equal(await page.locator('#plan-placement').count(), 1, 'the plan card shows no placement line (the plan answered no `placement`)');
    assert.match(await page.locator('#plan-placement').innerText(), /^Placement\s*\S/);
    // Every gradient policy is listed with its memory; choosing one from the card re-plans the
    // job with it, and the job then runs with it.
    const policies = await page.locator('#plan-gradients tbody tr').evaluateAll((rows) => rows.map((r) => r.dataset.policy));
    assert.deepEqual(policies, ['device', 'host', 'host_bf16', 'no_clip'], 'the plan card lists every gradient policy');
    assert.equal(await page.locator('#plan-gradients tr[data-chosen="true"]').getAttribute('data-policy'), 'device');
    // A CPU job's gradients are not said to wait "on the GPU".
    const gpus = (await (await page.request.get(url('/api/gpus'))).json()).filter((d) => d.id !== 'cpu');
    if (!gpus.length) {
      const row = await page.locator('#plan-gradients tr[data-policy="device"]').innerText();
      assert.doesNotMatch(row, /GPU/, `the device policy of a CPU job: ${row}`);
    }
    await page.click('#plan-gradients tr[data-policy="host_bf16"] button');
    await page.waitForSelector('#plan-gradients tr[data-policy="host_bf16"][data-chosen="true"]');
    assert.equal(await page.inputValue('#gradients'), 'host_bf16');
    assert.ok(await page.locator('#command').isHidden(), 'the command is shown before it is asked for');
    assert.ok(await page.locator('#show-command').isEnabled(), 'no command to show (the plan answered no `command`)');
    await page.click('#show-command');
    const command = (await page.locator('#command').innerText()).trim();
    assert.match(command, /^sluice train\b/, `the equivalent command: ${command}`);
    assert.match(command, /f32/, `the equivalent command does not carry save_dtype f32: ${command}`);
    assert.match(command, /--gradients host_bf16/, `the equivalent command does not carry the gradient policy: ${command}`);
    await page.evaluate(() => window.scrollTo(0, 0));
    await screenshot('new-job');
    await page.click('#submit');
    await page.waitForURL(/\/jobs\/\d+$/);
    jobId = Number(new URL(page.url()).pathname.split('/').pop());
    // The job page lists the settings it runs with, and its disk use.
    const saveDtype = page.locator('#settings [data-setting="save_dtype"] dd');
    await saveDtype.waitFor();
    assert.equal(await saveDtype.innerText(), 'f32');
    assert.equal(await page.locator('#settings [data-setting="gradients"] dd').innerText(), 'host_bf16');
    assert.match(await page.locator('#settings [data-setting="save_every"] dd').innerText(), new RegExp(`^${SAVE_EVERY}\\b`));
    assert.match(await page.locator('[data-fact="disk"] .v').innerText(), /^\d[\d.]* (B|KiB|MiB|GiB|TiB)$/);
    noErrorsSoFar();
  });

  await t.test('the loss chart gains points while the job runs', async () => {
    const seen = [];
    const deadline = Date.now() + 4 * 60_000;
    const started = Date.now();
    for (;;) {
      // One look at the page, without waiting for anything to appear.
      const look = await page.evaluate(() => ({
        n: Number(document.querySelector('[data-chart="loss"]')?.dataset.points),
        status: document.querySelector('#status .badge')?.dataset.status ?? null,
        plots: document.querySelectorAll('#charts .u-over').length,
        visibility: document.visibilityState,
        lossLabel: document.querySelector('#run-summary [data-fact="final_loss"] .k')?.textContent ?? null,
      }));
      const { n, status } = look;
      const at = `${n}@${((Date.now() - started) / 1000).toFixed(1)}s:${status}:${look.visibility}`;
      if (seen[seen.length - 1]?.split('@')[0] !== String(n)) seen.push(at);
      if (n > 0 && status === 'running' && !look.plots) {
        assert.fail('the loss chart has points but no plot');
      }
      // A running job's loss is the latest, not yet the final one.
      if (status === 'running') assert.equal(look.lossLabel, 'Latest loss');
      if (status === 'running' && n >= 3 && !existsShot.running) {
        await screenshot('job', { fullPage: true });
        existsShot.running = true;
      }
      if (status === 'completed' && n >= STEPS) break;
      if (status === 'failed' || status === 'cancelled' || status === 'interrupted') {
        assert.fail(`the job ended ${status}: ${await page.locator('#job-failure').innerText()}\n${server.log()}`);
      }
      if (Date.now() > deadline) {
        // Bounded, so a server that stopped answering says so instead of hanging the test.
        const job = await page.evaluate(async (p) => (await fetch(p, { signal: AbortSignal.timeout(5000) })).text(), `/api/jobs/${jobId}`).catch((e) => String(e));
        assert.fail(`the job did not complete in time; points seen: ${seen.join(' → ')}\njob: ${job}\nserver log (end): ${server.log().slice(-4000)}`);
      }
      await page.waitForTimeout(150);
    }
    // Live drawing: the chart grew in steps, not all at once at the end.
    const counts = seen.map((s) => Number(s.split('@')[0]));
    const growing = counts.filter((n) => n > 0 && n < STEPS);
    assert.ok(growing.length >= 1, `points seen: ${seen.join(' → ')}`);
    assert.equal(counts[counts.length - 1], STEPS);
    for (let i = 1; i < counts.length; i += 1) assert.ok(counts[i] >= counts[i - 1], `points went down: ${seen.join(' → ')}`);
    if (!existsShot.running) await screenshot('job', { fullPage: true });
    noErrorsSoFar();
  });

  await t.test('a reload keeps every point', async () => {
    const before = await chartPoints('loss');
    const lrBefore = await chartPoints('lr');
    await page.reload();
    await page.waitForFunction((n) => Number(document.querySelector('[data-chart="loss"]')?.dataset.points) === n, before);
    assert.equal(await chartPoints('lr'), lrBefore);
    assert.ok(await page.locator('[data-chart="loss"] canvas').count() >= 1, 'the loss chart is drawn');
    // The optimizer chart tells its total from the part the step waited for.
    const legend = await page.locator('[data-chart="optimizer_s"] .u-legend').innerText();
    assert.match(legend, /total/, legend);
    assert.match(legend, /exposed/, legend);
    // The finished run's folder holds its checkpoints: more than nothing on disk.
    const disk = await page.locator('[data-fact="disk"] .v').innerText();
    assert.match(disk, /^\d[\d.]* (KiB|MiB|GiB|TiB)$/, `disk used after the run: ${disk}`);
    noErrorsSoFar();
  });

  await t.test('the checkpoint archive downloads as a tar with config.json', async () => {
    const link = page.locator('[data-archive]').first();
    await link.waitFor({ timeout: 30_000 });
    checkpointName = await link.getAttribute('data-archive');
    const [download] = await Promise.all([page.waitForEvent('download'), link.click()]);
    const saved = path.join(server.dataDir, 'download.tar');
    await download.saveAs(saved);
    const members = tarMembers(readFileSync(saved));
    const names = members.map((m) => m.name);
    assert.ok(names.some((n) => path.posix.basename(n) === 'config.json'), `archive members: ${names.join(', ')}`);
    assert.ok(members.some((m) => m.name.endsWith('.safetensors') && m.size > 0), `archive members: ${names.join(', ')}`);
    // The job kept the form's default, bf16: every tensor of the download is BF16. (A
    // safetensors file starts with its JSON header's length, a little-endian u64, then the
    // header.)
    for (const member of members.filter((m) => m.name.endsWith('.safetensors'))) {
      const length = Number(member.data.readBigUInt64LE(0));
      const header = JSON.parse(member.data.subarray(8, 8 + length).toString('utf8'));
      const dtypes = new Set(Object.entries(header).filter(([k]) => k !== '__metadata__').map(([, t]) => t.dtype));
      assert.deepEqual([...dtypes], ['BF16'], `${member.name}: tensors of ${[...dtypes].join(', ')}`);
    }
  });

  await t.test('a checkpoint answers a two-turn chat, streamed token by token', async () => {
    // The card lists the checkpoints; the server may answer on a GPU when it has one.
    await page.locator('#try').waitFor({ state: 'visible' });
    assert.ok(await page.locator('#try-checkpoint option').count() >= 1, 'no checkpoint to try');
    const devices = (await (await page.request.get(url('/api/gpus'))).json()).map((d) => d.id);
    const generated = (r) => r.request().method() === 'POST' && /\/checkpoints\/[^/]+\/generate$/.test(new URL(r.url()).pathname);
    await page.click('#try-options > summary');
    await page.fill('#try-tokens', '16');
    const turns = page.locator('#try-conversation .turn');
    const modelTurns = page.locator('#try-conversation .turn.model');

    /** Sends a message as a person does and checks the streamed answer the page shows. */
    async function chat(message, send) {
      await page.fill('#try-message', message);
      const replied = page.waitForResponse(generated, { timeout: 60_000 });
      await send();
      const response = await replied;
      if (response.status() !== 200) {
        await page.locator('#try-error').waitFor({ state: 'visible' });
        assert.fail(`the checkpoint did not answer (${response.status()}): ${await page.locator('#try-error').innerText()}\n${server.log()}`);
      }
      const type = response.headers()['content-type'] || '';
      assert.match(type, /^text\/event-stream/);
      const body = response.request().postDataJSON();
      assert.equal(body.stream, true);
      assert.equal(body.max_new_tokens, 16);
      const text = await response.text();
      const events = sseEvents(text);
      const parsed = await pageParsesAtEveryCut(text);
      assert.equal(parsed.cut, null, `the page's parser reads other events when the body is cut at ${parsed.cut}`);
      assert.deepEqual(JSON.parse(parsed.whole), events, "the page's parser and the test's read different events");
      const names = events.map((e) => e.name);
      assert.equal(names[0], 'start', `events: ${names.join(' ')}`);
      assert.equal(names[names.length - 1], 'done', `events: ${names.join(' ')}\n${JSON.stringify(events[events.length - 1])}`);
      assert.ok(names.slice(1, -1).every((n) => n === 'token'), `events: ${names.join(' ')}`);
      const done = events[events.length - 1].data;
      assert.equal(events.filter((e) => e.name === 'token').map((e) => e.data.text).join(''), done.text, 'the tokens add up to the answer');
      // The page shows that answer, and under it where it ran, as a muted line.
      const last = (await modelTurns.count()) - 1;
      const turn = modelTurns.nth(last);
      await page.waitForFunction((n) => document.querySelectorAll('#try-conversation .turn.model')[n]?.dataset.state !== 'streaming',
        last, { timeout: 60_000 });
      assert.equal(await turn.getAttribute('data-state'), 'done', `${await turn.innerText()}\n${await page.locator('#try-error').innerText()}`);
      const shown = await turn.locator('.text').textContent();
      if (done.text) assert.equal(await asPlaywrightReads(shown, type), done.text, 'the page shows the answer the server sent');
      else assert.equal(shown, '(the model ended at once, with no text)');
      const expectedDevice = devices.length === 1 ? 'cpu' : done.device;
      assert.ok(devices.includes(done.device), `answered on ${done.device}; devices: ${devices.join(', ')}`);
      assert.equal(await turn.locator('.stats').getAttribute('data-device'), expectedDevice);
      const stats = await turn.locator('.stats').innerText();
      assert.ok(stats.startsWith(`${expectedDevice} · ${done.tokens} token`), `the line under the answer: ${stats}`);
      if (done.tokens > 0) assert.match(stats, / · \S+ tokens\/s/, `the line under the answer: ${stats}`);
      assert.equal(await turn.locator('.note').isVisible(), done.chat === false, 'the "no chat template" note');
      return body;
    }

    // Enter sends; the message leaves the box and shows as the first user turn.
    const first = await chat('Hello! Who are you?', () => page.press('#try-message', 'Enter'));
    assert.deepEqual(first.messages, [{ role: 'user', content: 'Hello! Who are you?' }]);
    assert.equal(await page.inputValue('#try-message'), '');
    // What the history carries for that answer: its text ('' when the model ended at once).
    const noText = (await modelTurns.first().locator('.text .muted').count()) > 0;
    const answer = noText ? '' : await modelTurns.first().locator('.text').textContent();
    // Shift+Enter starts a new line instead of sending.
    await page.fill('#try-message', 'Tell me more');
    await page.press('#try-message', 'Shift+Enter');
    assert.equal(await page.inputValue('#try-message'), 'Tell me more\n');
    assert.equal(await turns.count(), 2);
    // The second message goes with the history: the first question and the model's answer.
    const second = await chat('Tell me more.', () => page.click('#try-send'));
    assert.deepEqual(second.messages.map((m) => m.role), ['user', 'assistant', 'user']);
    assert.equal(second.messages[2].content, 'Tell me more.');
    assert.deepEqual(second.messages[1], { role: 'assistant', content: answer });
    assert.equal(await page.locator('#try-conversation .turn.user').count(), 2);
    assert.equal(await modelTurns.count(), 2);
    assert.deepEqual(await page.locator('#try-conversation .turn.user .body').allTextContents(), ['Hello! Who are you?', 'Tell me more.']);
    assert.ok(await page.locator('#try-stop').isHidden(), 'Stop is still shown after the answers');
    assert.ok(await page.locator('#try-error').isHidden());
    // "New conversation" clears both turns of each.
    await page.click('#try-new');
    assert.equal(await turns.count(), 0);
    assert.ok(await page.locator('#try-new').isDisabled());
    noErrorsSoFar();
  });

  await t.test('the dashboard lists the job', async () => {
    await page.goto(url('/'));
    await page.waitForSelector(`#jobs-table tr[data-job="${jobId}"] .badge[data-status="completed"]`);
    await page.waitForSelector('#gpus .gpu[data-gpu="cpu"]');
    await screenshot('dashboard');
  });

  await t.test('the next new job starts from the dataset last used', async () => {
    await page.goto(url('/jobs/new'));
    await page.waitForSelector(`#dataset option[value="${datasetId}"]`, { state: 'attached' });
    await page.waitForFunction((id) => document.querySelector('#dataset').value === String(id), datasetId);
  });

  const privateUrls = () => [
    `/api/jobs/${jobId}`,
    `/api/jobs/${jobId}/metrics`,
    `/api/jobs/${jobId}/log`,
    `/api/jobs/${jobId}/checkpoints`,
    `/api/jobs/${jobId}/checkpoints/${encodeURIComponent(checkpointName)}/archive`,
    `/api/jobs/${jobId}/checkpoints/${encodeURIComponent(checkpointName)}/files/config.json`,
    `/api/datasets/${datasetId}`,
    `/api/datasets/${datasetId}/preview?model=preset:tiny&limit=2`,
  ];

  await t.test('the owner can fetch every private URL', async () => {
    for (const p of privateUrls()) {
      const response = await page.request.get(url(p));
      assert.equal(response.status(), 200, `${p} as the owner`);
    }
  });

  await t.test('the administrator adds a second user', async () => {
    await page.click('nav a[href="/admin/users"]');
    await page.fill('#new-username', OTHER.username);
    await page.fill('#new-password', OTHER.password);
    await page.selectOption('#new-role', 'user');
    await page.click('#user-form button[type=submit]');
    await page.waitForSelector(`#users-table tr[data-user="${OTHER.username}"]`);
    await page.click('#logout');
    await page.waitForURL(/\/login/);
    await page.fill('#username', OTHER.username);
    await page.fill('#password', OTHER.password);
    await page.click('button[type=submit]');
    await page.waitForURL(url('/'));
    await page.waitForSelector('#who-name:has-text("bob")');
    assert.ok(await page.locator('nav a[href="/admin/users"]').isHidden(), 'a user sees the admin link');
    noErrorsSoFar();
  });

  await t.test('after logging in, a next= that leads off the site goes home instead', async () => {
    await page.click('#logout');
    await page.waitForURL(/\/login/);
    // A tab inside "/<tab>/evil.example" is dropped by the URL parser, leaving "//evil.example".
    await page.goto(url('/login?next=%2F%09%2Fevil.example'));
    await page.fill('#username', OTHER.username);
    await page.fill('#password', OTHER.password);
    await page.click('button[type=submit]');
    await page.waitForURL(url('/'));
    assert.equal(new URL(page.url()).origin, new URL(server.url).origin);
    await page.waitForSelector('#who-name:has-text("bob")');
    noErrorsSoFar();
  });

  await t.test("the second user sees none of the first user's things in the pages", async () => {
    await page.waitForSelector('#jobs .empty');
    assert.equal(await page.locator(`[data-job="${jobId}"]`).count(), 0);
    await page.goto(url('/datasets'));
    await page.waitForSelector('#datasets table, #datasets .empty');
    assert.equal(await page.locator(`[data-dataset="${datasetId}"]`).count(), 0);
    // Another user's job and dataset answer the plain not-found page, as ids that do not exist.
    for (const path of [`/jobs/${jobId}`, `/datasets/${datasetId}`]) {
      const reply = await page.goto(url(path));
      assert.equal(reply.status(), 404, path);
      assert.match(await page.locator('h1').innerText(), /Page not found/);
      assert.equal(await page.locator('#first-data').count(), 0);
    }
    // So do the admin's pages.
    for (const path of ['/admin/users', '/admin/storage']) {
      assert.equal((await page.goto(url(path))).status(), 404, path);
    }
    await page.goto(url('/jobs/new'));
    await page.waitForSelector('#plan-fits, #plan .alert');
    assert.equal(await page.locator(`#dataset option[value="${datasetId}"]`).count(), 0);
  });

  await t.test("the second user's direct API requests for them answer 404", async () => {
    for (const p of privateUrls()) {
      const response = await page.request.get(url(p));
      assert.equal(response.status(), 404, `${p} as another user`);
    }
    const jobs = await (await page.request.get(url('/api/jobs'))).json();
    assert.deepEqual(jobs, []);
    // Only the bundled, shared datasets (no owner) remain visible.
    const datasets = await (await page.request.get(url('/api/datasets'))).json();
    assert.deepEqual(datasets.filter((d) => d.id === datasetId || d.owner !== null), []);
    const session = await (await page.request.get(url('/api/session'))).json();
    const cancel = await page.request.post(url(`/api/jobs/${jobId}/cancel`), { headers: { 'X-CSRF-Token': session.csrf } });
    assert.equal(cancel.status(), 404);
    const remove = await page.request.delete(url(`/api/datasets/${datasetId}`), { headers: { 'X-CSRF-Token': session.csrf } });
    assert.equal(remove.status(), 404);
  });

  await t.test('the pages fetched nothing from outside and raised no script error', () => {
    noErrorsSoFar();
  });
});

