// The signed-in user's account: personal API tokens (created, shown once, revoked), the
// webhook their jobs' ends are posted to, with how its latest delivery went, and their password.
import { del, get, post, request, requireUser } from '../api.js';
import { $, copyText, el, fill, fmtDate, showError } from '../ui.js';

const me = await requireUser();
$('#password-username').value = me.username;

function renderTokens(tokens) {
  if (!tokens.length) {
    fill($('#tokens'), el('p', { class: 'empty' }, 'No tokens yet.'));
    return;
  }
  fill($('#tokens'), el('table', { class: 'list', id: 'tokens-table' },
    el('thead', {}, el('tr', {}, ['Name', 'Token', 'Created', 'Last used', ''].map((h) => el('th', {}, h)))),
    el('tbody', {}, tokens.map((t) => el('tr', { dataset: { token: t.name } },
      el('td', {}, t.name),
      el('td', { class: 'mono small' }, `${t.prefix}…`),
      el('td', { class: 'small muted' }, fmtDate(t.created_at)),
      el('td', { class: 'small muted', dataset: { lastUsed: '' } }, t.last_used_at ? fmtDate(t.last_used_at) : 'never'),
      el('td', { class: 'actions' },
        el('button', { type: 'button', class: 'small danger', onclick: () => revoke(t) }, 'Revoke')))))));
}

async function refreshTokens() {
  try {
    renderTokens(await get('/api/account/tokens'));
  } catch (err) {
    fill($('#tokens'));
    showError($('#error'), err);
  }
}

async function revoke(token) {
  if (!confirm(`Revoke the token “${token.name}”? Scripts using it will stop working.`)) return;
  try {
    await del(`/api/account/tokens/${token.id}`);
    $('#new-token').hidden = true;
    await refreshTokens();
  } catch (err) {
    showError($('#error'), err);
  }
}

$('#token-form').addEventListener('submit', async (event) => {
  event.preventDefault();
  showError($('#token-error'), null);
  try {
    const created = await post('/api/account/tokens', { name: $('#token-name').value });
    $('#new-token-value').textContent = created.token;
    $('#new-token').hidden = false;
    event.target.reset();
    await refreshTokens();
  } catch (err) {
    showError($('#token-error'), err);
  }
});

$('#copy-token').addEventListener('click', async () => {
  const copied = await copyText($('#new-token-value').textContent);
  $('#copy-token-note').textContent = copied ? 'Copied.' : 'Could not copy: select the text and copy it by hand.';
});

function renderWebhook(hook) {
  $('#webhook-url').value = hook ? hook.url : '';
  $('#webhook-test').disabled = !hook;
  const last = $('#webhook-last');
  if (!hook) {
    last.textContent = 'No webhook: nothing is sent when your jobs end.';
    return;
  }
  if (!hook.last_at) {
    last.textContent = 'Nothing sent yet.';
    return;
  }
  const about = hook.last_job_id ? `job ${hook.last_job_id}` : 'a test';
  fill(last,
    el('span', { class: `badge ${hook.last_ok ? 'fits' : 'nofit'}`, id: 'webhook-status', dataset: { ok: String(Boolean(hook.last_ok)) } },
      hook.last_ok ? 'Delivered' : 'Failed'),
    ` Latest delivery, for ${about}, ${fmtDate(hook.last_at)}: ${hook.last_result}`);
}

async function refreshWebhook() {
  try {
    renderWebhook((await get('/api/account/webhook')).webhook);
  } catch (err) {
    showError($('#error'), err);
  }
}

$('#webhook-form').addEventListener('submit', async (event) => {
  event.preventDefault();
  showError($('#webhook-error'), null);
  $('#webhook-ok').hidden = true;
  try {
    const url = $('#webhook-url').value.trim();
    const reply = await request('PUT', '/api/account/webhook', { url });
    renderWebhook(reply.webhook);
    $('#webhook-ok').textContent = url ? 'Saved: your jobs’ ends will be sent there.' : 'Removed: nothing will be sent.';
    $('#webhook-ok').hidden = false;
  } catch (err) {
    showError($('#webhook-error'), err);
  }
});

$('#webhook-test').addEventListener('click', async () => {
  showError($('#webhook-error'), null);
  $('#webhook-ok').hidden = true;
  const button = $('#webhook-test');
  button.disabled = true;
  try {
    const reply = await post('/api/account/webhook/test');
    renderWebhook(reply.webhook);
  } catch (err) {
    showError($('#webhook-error'), err);
  } finally {
    button.disabled = false;
  }
});

$('#password-form').addEventListener('submit', async (event) => {
  event.preventDefault();
  showError($('#password-error'), null);
  $('#password-ok').hidden = true;
  const password = $('#new-password').value;
  if (password !== $('#new-password2').value) {
    showError($('#password-error'), new Error('The two new passwords differ.'));
    return;
  }
  const button = event.submitter;
  if (button) button.disabled = true;
  try {
    await post('/api/account/password', { current_password: $('#current-password').value, new_password: password });
    event.target.reset();
    $('#password-ok').textContent = 'Changed. Your other sessions are logged out; this one stays.';
    $('#password-ok').hidden = false;
  } catch (err) {
    showError($('#password-error'), err);
  } finally {
    if (button) button.disabled = false;
  }
});

await Promise.all([refreshTokens(), refreshWebhook()]);
