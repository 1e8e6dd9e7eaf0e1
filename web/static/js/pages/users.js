// Account management, for administrators: the accounts (with a warning where many logins
// failed lately), new accounts, a new password for someone, and deletes.
import { del, get, post, request, requireUser } from '../api.js';
import { $, el, fill, fmtDate, showError } from '../ui.js';

const me = await requireUser();

/** "12 failed logins from 5 addresses, latest …": the throttle's alert for one account. */
function failedLogins(alert) {
  const from = alert.addresses === 1 ? 'one address' : `${alert.addresses} addresses`;
  return `${alert.count} failed logins from ${from}, latest ${fmtDate(alert.last_at)}`;
}

function renderAlerts(users) {
  const guessed = users.filter((u) => u.failed_logins);
  const box = $('#login-alerts');
  box.hidden = !guessed.length;
  if (!guessed.length) return;
  fill(box,
    el('strong', {}, 'Someone may be guessing passwords.'),
    ' Logins still work for anyone who has the password: ',
    ...guessed.flatMap((u, i) => [i ? '; ' : '', el('strong', {}, u.username), ` (${failedLogins(u.failed_logins)})`]),
    '. Set a new password for an account whose password may be weak or known to others.');
}

function actions(user) {
  if (user.id === me.id) {
    return el('a', { class: 'btn small', href: '/account' }, 'Change password');
  }
  return [
    el('button', { type: 'button', class: 'small', onclick: () => openReset(user) }, 'Set password'),
    ' ',
    el('button', { type: 'button', class: 'small danger', onclick: () => remove(user) }, 'Delete'),
  ];
}

function render(users) {
  renderAlerts(users);
  fill($('#users'), el('table', { class: 'list', id: 'users-table' },
    el('thead', {}, el('tr', {}, ['Username', 'Role', 'Created', ''].map((h) => el('th', {}, h)))),
    el('tbody', {}, users.map((u) => el('tr', { dataset: { user: u.username } },
      el('td', {}, u.username, u.id === me.id ? el('span', { class: 'muted small' }, ' (you)') : null,
        u.failed_logins ? [' ', el('span', { class: 'badge warn', title: failedLogins(u.failed_logins) },
          `${u.failed_logins.count} failed logins`)] : null),
      el('td', {}, el('span', { class: 'badge' }, u.role)),
      el('td', { class: 'small muted' }, fmtDate(u.created_at)),
      el('td', { class: 'actions' }, actions(u)))))));
}

async function refresh() {
  try {
    render(await get('/api/users'));
    showError($('#error'), null);
  } catch (err) {
    fill($('#users'));
    showError($('#error'), err);
  }
}

async function remove(user) {
  if (!confirm(`Delete the account “${user.username}”?`)) return;
  try {
    await del(`/api/users/${user.id}`);
    closeReset();
    await refresh();
  } catch (err) {
    showError($('#error'), err);
  }
}

let resetting = null;

function openReset(user) {
  resetting = user;
  const form = $('#reset-form');
  form.reset();
  showError($('#reset-error'), null);
  $('#reset-done').hidden = true;
  $('#reset-name').textContent = user.username;
  $('#reset-username').value = user.username;
  form.hidden = false;
  $('#reset-password').focus();
}

function closeReset() {
  resetting = null;
  $('#reset-form').hidden = true;
}

$('#reset-cancel').addEventListener('click', closeReset);

$('#reset-form').addEventListener('submit', async (event) => {
  event.preventDefault();
  if (!resetting) return;
  const user = resetting;
  showError($('#reset-error'), null);
  const button = event.submitter;
  if (button) button.disabled = true;
  try {
    await request('PUT', `/api/users/${user.id}/password`, { password: $('#reset-password').value });
    closeReset();
    $('#reset-done').textContent = `${user.username} has a new password and was logged out everywhere: tell them the new one.`;
    $('#reset-done').hidden = false;
  } catch (err) {
    showError($('#reset-error'), err);
  } finally {
    if (button) button.disabled = false;
  }
});

$('#user-form').addEventListener('submit', async (event) => {
  event.preventDefault();
  const username = $('#new-username').value.trim();
  showError($('#form-error'), null);
  $('#form-ok').hidden = true;
  try {
    await post('/api/users', { username, password: $('#new-password').value, role: $('#new-role').value });
    event.target.reset();
    $('#form-ok').textContent = `Added ${username}.`;
    $('#form-ok').hidden = false;
    await refresh();
  } catch (err) {
    showError($('#form-error'), err);
  }
});

if (me.role !== 'admin') {
  showError($('#error'), new Error('Only administrators manage accounts.'));
  fill($('#users'));
  $('#user-form').hidden = true;
} else {
  await refresh();
}
