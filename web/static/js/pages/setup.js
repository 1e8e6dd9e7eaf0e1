// First run: create the administrator, who is then logged in.
import { post, session } from '../api.js';
import { $, showError } from '../ui.js';

$('#setup-form').addEventListener('submit', async (event) => {
  event.preventDefault();
  const error = $('#error');
  const username = $('#username').value.trim();
  const password = $('#password').value;
  if (password !== $('#password2').value) {
    showError(error, new Error('The two passwords differ.'));
    return;
  }
  const button = event.submitter;
  if (button) button.disabled = true;
  try {
    await post('/api/setup', { username, password });
    location.href = '/';
  } catch (err) {
    showError(error, err);
    if (button) button.disabled = false;
  }
});

// Handlers first: a form submitted while this check runs still goes through them.
const s = await session();
if (!s.setup_needed) location.replace(s.user ? '/' : '/login');
