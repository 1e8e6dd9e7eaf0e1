// The JSON API, as the pages use it: the session (with its CSRF token), requests that throw an
// ApiError carrying the server's message, and an upload with progress.

/** An API answer that was not 2xx; `message` is meant for the user. */
export class ApiError extends Error {
  constructor(status, message, problems = []) {
    super(message);
    this.status = status;
    this.problems = problems;
  }
}

let sessionPromise = null;

/** `GET /api/session`, fetched once per page. */
export function session() {
  if (!sessionPromise) {
    sessionPromise = request('GET', '/api/session').catch((err) => {
      sessionPromise = null;
      throw err;
    });
  }
  return sessionPromise;
}

async function errorFrom(response) {
  let message = `The server answered ${response.status} ${response.statusText}.`;
  let problems = [];
  try {
    const body = await response.json();
    if (body && typeof body.error === 'string') message = body.error;
    if (body && Array.isArray(body.problems)) problems = body.problems.map(String);
  } catch {
    if (response.status === 413) message = 'The file is larger than this server accepts.';
  }
  return new ApiError(response.status, message, problems);
}

/** Sends a request and returns the parsed JSON (or text for non-JSON answers). */
export async function request(method, path, body) {
  const headers = { Accept: 'application/json' };
  if (method !== 'GET' && method !== 'HEAD') {
    const { csrf } = path === '/api/session' ? {} : await session();
    if (csrf) headers['X-CSRF-Token'] = csrf;
  }
  let payload;
  if (body !== undefined) {
    headers['Content-Type'] = 'application/json';
    payload = JSON.stringify(body);
  }
  let response;
  try {
    response = await fetch(path, { method, headers, body: payload, credentials: 'same-origin' });
  } catch {
    throw new ApiError(0, 'Cannot reach the Sluice server. Is it still running?');
  }
  if (response.status === 401 && !['/api/login', '/api/setup'].includes(path) && location.pathname !== '/login') {
    // The session expired (or the server restarted with new keys): log in again, then come back.
    location.href = `/login?next=${encodeURIComponent(location.pathname + location.search)}`;
    return new Promise(() => {});
  }
  if (!response.ok) throw await errorFrom(response);
  if (response.status === 204) return null;
  const type = response.headers.get('Content-Type') || '';
  return type.includes('json') ? response.json() : response.text();
}

export const get = (path) => request('GET', path);
export const post = (path, body = {}) => request('POST', path, body);
export const del = (path) => request('DELETE', path);

/**
 * Uploads a multipart form with progress (fetch cannot report upload progress; XHR can).
 * `onProgress(sent, total)` is called as bytes leave the browser.
 */
export async function upload(path, form, onProgress) {
  const { csrf } = await session();
  return new Promise((resolve, reject) => {
    const xhr = new XMLHttpRequest();
    xhr.open('POST', path);
    xhr.setRequestHeader('X-CSRF-Token', csrf || '');
    xhr.setRequestHeader('Accept', 'application/json');
    xhr.upload.onprogress = (event) => {
      if (event.lengthComputable) onProgress(event.loaded, event.total);
    };
    xhr.onerror = () => reject(new ApiError(0, 'The upload was interrupted. Is the server still running?'));
    xhr.onload = () => {
      let body = null;
      try {
        body = JSON.parse(xhr.responseText);
      } catch {
        body = null;
      }
      if (xhr.status >= 200 && xhr.status < 300) {
        resolve(body);
        return;
      }
      let message = (body && body.error) || `The server answered ${xhr.status}.`;
      if (xhr.status === 413 && !(body && body.error)) message = 'The file is larger than this server accepts.';
      const problems = body && Array.isArray(body.problems) ? body.problems.map(String) : [];
      reject(new ApiError(xhr.status, message, problems));
    };
    xhr.send(form);
  });
}

/** Where to go after logging in: only paths on this site. */
export function safeNext(raw) {
  if (typeof raw !== 'string' || !raw.startsWith('/') || raw.startsWith('//') || raw.startsWith('/\\')) return '/';
  return raw;
}

/**
 * For every page behind the login: sends visitors without a session to setup or login, fills in
 * the top bar, and returns the signed-in user.
 */
export async function requireUser() {
  const s = await session();
  if (s.setup_needed) {
    location.replace('/setup');
    return new Promise(() => {});
  }
  if (!s.user) {
    const next = location.pathname + location.search;
    location.replace(`/login?next=${encodeURIComponent(next)}`);
    return new Promise(() => {});
  }
  const name = document.getElementById('who-name');
  if (name) name.textContent = s.user.username + (s.user.role === 'admin' ? ' (admin)' : '');
  if (s.user.role === 'admin') {
    for (const el of document.querySelectorAll('[data-admin-only]')) el.hidden = false;
  }
  const logout = document.getElementById('logout');
  if (logout) {
    logout.addEventListener('click', async () => {
      try {
        await post('/api/logout');
      } finally {
        location.href = '/login';
      }
    });
  }
  return s.user;
}
