// Log in, then go back to the page that sent us here.
import { post, safeNext, session } from '../api.js';
import { $, showError } from '../ui.js';

const next = safeNext(new URLSearchParams(location.search).get('next'));
$('#login-form').addEventListener('submit', async (event) => {
  event.preventDefault();
  const button = event.submitter;
  if (button) button.disabled = true;
  try {
    await post('/api/login', { username: $('#username').value.trim(), password: $('#password').value });
    location.href = next;
  } catch (err) {
    showError($('#error'), err);
    if (button) button.disabled = false;
  }
});

// Handlers first: a form submitted while this check runs still goes through them.
const s = await session();
if (s.setup_needed) location.replace('/setup');
else if (s.user) location.replace(next);
