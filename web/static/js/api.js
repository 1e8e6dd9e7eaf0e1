// The JSON API, as the pages use it: the session (with its CSRF token), requests that throw an
// ApiError carrying the server's message, a POST whose answer streams as server-sent events, and
// an upload with progress.

/**
 * An API answer that was not 2xx; `message` is meant for the user. `problems` lists the first
 * problems (a refused dataset's bad records) and `unlisted` counts the rest.
 */
export class ApiError extends Error {
  constructor(status, message, problems = [], unlisted = 0) {
    super(message);
    this.status = status;
    this.problems = problems;
    this.unlisted = unlisted;
  }
}

let embedded;

/**
 * What the server embedded in the page for its script's first render (`#first-data`: the
 * session, and the job, dataset or job list the page shows), taken once: `undefined` when it
 * embedded no `key` or it was taken already, so later refreshes ask the API.
 */
export function firstData(key) {
  if (embedded === undefined) {
    const holder = document.getElementById('first-data');
    try {
      embedded = holder ? JSON.parse(holder.textContent) : {};
    } catch {
      embedded = {};
    }
  }
  const value = embedded[key];
  delete embedded[key];
  return value;
}

let sessionPromise = null;

/** The session: embedded in pages behind the login, else `GET /api/session`, once per page. */
export function session() {
  if (!sessionPromise) {
    const given = firstData('session');
    if (given) {
      sessionPromise = Promise.resolve(given);
      return sessionPromise;
    }
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
  let unlisted = 0;
  try {
    const body = await response.json();
    if (body && typeof body.error === 'string') message = body.error;
    if (body && Array.isArray(body.problems)) problems = body.problems.map(String);
    if (body && Number.isInteger(body.unlisted)) unlisted = body.unlisted;
  } catch {
    if (response.status === 413) message = 'The file is larger than this server accepts.';
  }
  return new ApiError(response.status, message, problems, unlisted);
}

/** The session expired (or the server restarted with new keys): log in again, then come back. */
function sendToLogin() {
  location.href = `/login?next=${encodeURIComponent(location.pathname + location.search)}`;
  return new Promise(() => {});
}

const needsLogin = (response, path) =>
  response.status === 401 && !['/api/login', '/api/setup'].includes(path) && location.pathname !== '/login';

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
  if (needsLogin(response, path)) return sendToLogin();
  if (!response.ok) throw await errorFrom(response);
  if (response.status === 204) return null;
  const type = response.headers.get('Content-Type') || '';
  return type.includes('json') ? response.json() : response.text();
}

export const get = (path) => request('GET', path);
export const post = (path, body = {}) => request('POST', path, body);
export const del = (path) => request('DELETE', path);

/**
 * A reader of the server-sent events format (the WHATWG "event stream" rules): feed it text as it
 * arrives with `push`, in pieces cut anywhere; it calls `onFrame(name, data)` once per complete
 * frame, a frame ending at a blank line. `event:` names the frame ("message" when absent), each
 * `data:` line adds a line to its data, a line starting with `:` is a comment, and a frame
 * without data is dropped. `end()` drops an unfinished frame, as EventSource does.
 */
export function sseParser(onFrame) {
  let buffer = '';
  let name = '';
  let data = [];
  const line = (text) => {
    if (text === '') {
      if (data.length) onFrame(name || 'message', data.join('\n'));
      name = '';
      data = [];
      return;
    }
    if (text.startsWith(':')) return;
    const colon = text.indexOf(':');
    const field = colon < 0 ? text : text.slice(0, colon);
    let value = colon < 0 ? '' : text.slice(colon + 1);
    if (value.startsWith(' ')) value = value.slice(1);
    if (field === 'event') name = value;
    else if (field === 'data') data.push(value);
    // `id` and `retry` only matter to a reconnecting EventSource.
  };
  return {
    push(text) {
      buffer += text;
      let start = 0;
      for (let i = 0; i < buffer.length; i += 1) {
        const c = buffer[i];
        if (c !== '\n' && c !== '\r') continue;
        // A CR at the very end may be the first half of a CRLF cut in two: wait for more.
        if (c === '\r' && i === buffer.length - 1) break;
        line(buffer.slice(start, i));
        if (c === '\r' && buffer[i + 1] === '\n') i += 1;
        start = i + 1;
      }
      buffer = buffer.slice(start);
    },
    end() {
      if (buffer.endsWith('\r')) line(buffer.slice(0, -1));
      buffer = '';
      name = '';
      data = [];
    },
  };
}

/**
 * POSTs `body` as JSON (with the CSRF header, as `request` does) to an endpoint that answers with
 * server-sent events, and calls `onEvent(name, data)` for each event as it arrives, `data` parsed
 * as JSON (the raw text when it is not JSON). EventSource cannot POST, hence fetch and a reader.
 * Resolves when the stream ends. A status other than 2xx throws an ApiError with the server's
 * message; a 2xx JSON answer (a server that does not stream) comes as one `done` event. Aborting
 * `signal` rejects with the browser's AbortError, so the caller can tell it from a failure.
 */
export async function postStream(path, body, onEvent, { signal } = {}) {
  const { csrf } = await session();
  const headers = { Accept: 'text/event-stream', 'Content-Type': 'application/json' };
  if (csrf) headers['X-CSRF-Token'] = csrf;
  let response;
  try {
    response = await fetch(path, { method: 'POST', headers, body: JSON.stringify(body), credentials: 'same-origin', signal });
  } catch (err) {
    if (err && err.name === 'AbortError') throw err;
    throw new ApiError(0, 'Cannot reach the Sluice server. Is it still running?');
  }
  if (needsLogin(response, path)) return sendToLogin();
  if (!response.ok) throw await errorFrom(response);
  const type = response.headers.get('Content-Type') || '';
  if (!type.includes('text/event-stream')) {
    if (type.includes('json')) onEvent('done', await response.json());
    return;
  }
  const parser = sseParser((name, text) => {
    let data = text;
    try {
      data = JSON.parse(text);
    } catch {
      // Not JSON: handed over as text.
    }
    onEvent(name, data);
  });
  const reader = response.body.getReader();
  // One decoder for the whole stream, so a character whose bytes straddle two chunks survives.
  const decoder = new TextDecoder();
  try {
    for (;;) {
      let chunk;
      try {
        chunk = await reader.read();
      } catch (err) {
        if (err && err.name === 'AbortError') throw err;
        throw new ApiError(0, 'The connection to the server broke off before the answer was complete.');
      }
      if (chunk.done) break;
      parser.push(decoder.decode(chunk.value, { stream: true }));
    }
    parser.push(decoder.decode());
    parser.end();
  } catch (err) {
    // Also when onEvent threw: stop the download rather than leave it running.
    reader.cancel().catch(() => {});
    throw err;
  }
}

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
      const unlisted = body && Number.isInteger(body.unlisted) ? body.unlisted : 0;
      reject(new ApiError(xhr.status, message, problems, unlisted));
    };
    xhr.send(form);
  });
}

/**
 * Where to go after logging in: `raw` as an absolute URL on this site, else '/'. The string must
 * already be a path with one leading '/' and no character the URL parser would drop or reread
 * (tabs and newlines vanish, a backslash counts as '/', so '/\t/evil.example' means
 * '//evil.example'); the parsed URL must then still be on this origin. The parsed URL is what is
 * returned, so nothing is reinterpreted on the way to `location`.
 */
export function safeNext(raw, origin = location.origin) {
  if (typeof raw !== 'string' || !raw.startsWith('/') || raw.startsWith('//')) return '/';
  if (/[\u0000-\u0020\u007f\\]/.test(raw)) return '/';
  let url;
  try {
    url = new URL(raw, origin);
  } catch {
    return '/';
  }
  if (url.origin !== origin) return '/';
  return url.href;
}

/**
 * For every page behind the login: sends visitors without a session to setup or login (the
 * server does so first; this covers a session that ends while the page is open), wires the
 * top bar's logout (the server draws the bar for the user's role), and returns the user.
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
