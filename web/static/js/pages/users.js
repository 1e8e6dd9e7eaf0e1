// Account management, for administrators.
import { del, get, post, requireUser } from '../api.js';
import { $, el, fill, fmtDate, showError } from '../ui.js';

const me = await requireUser();

function render(users) {
  fill($('#users'), el('table', { class: 'list', id: 'users-table' },
    el('thead', {}, el('tr', {}, ['Username', 'Role', 'Created', ''].map((h) => el('th', {}, h)))),
    el('tbody', {}, users.map((u) => el('tr', { dataset: { user: u.username } },
      el('td', {}, u.username, u.id === me.id ? el('span', { class: 'muted small' }, ' (you)') : null),
      el('td', {}, el('span', { class: 'badge' }, u.role)),
      el('td', { class: 'small muted' }, fmtDate(u.created_at)),
      el('td', { class: 'actions' }, u.id === me.id ? null
        : el('button', { type: 'button', class: 'small danger', onclick: () => remove(u) }, 'Delete')))))));
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
    await refresh();
  } catch (err) {
    showError($('#error'), err);
  }
}

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
