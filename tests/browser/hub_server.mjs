// A local stand-in for the Hugging Face Hub: model folders served in the Hub's URL layout
// (`/api/models/{repo}/revision/{rev}?blobs=true` with siblings and LFS sha256s,
// `/{repo}/resolve/{rev}/{file}` with ETag, X-Repo-Commit and byte ranges).
import { createHash } from 'node:crypto';
import { createReadStream, readdirSync, statSync } from 'node:fs';
import http from 'node:http';
import path from 'node:path';

function digest(file, algorithm, prefix = null) {
  return new Promise((resolve, reject) => {
    const hash = createHash(algorithm);
    if (prefix) hash.update(prefix);
    createReadStream(file).on('data', (chunk) => hash.update(chunk)).on('error', reject)
      .on('end', () => resolve(hash.digest('hex')));
  });
}

/** Files of `dir` as the Hub lists them; safetensors are LFS files. */
async function describe(dir) {
  const files = new Map();
  for (const name of readdirSync(dir)) {
    const file = path.join(dir, name);
    const { size } = statSync(file);
    const lfs = name.endsWith('.safetensors');
    files.set(name, {
      file,
      size,
      sha256: lfs ? await digest(file, 'sha256') : null,
      blobId: await digest(file, 'sha1', `blob ${size}\0`),
    });
  }
  return files;
}

/** `repos`: { 'Org/Name': { dir, commit } } (commit: 40 hex digits; `main` points at it). */
export async function startHub(repos) {
  const served = new Map();
  for (const [repo, { dir, commit }] of Object.entries(repos)) {
    served.set(repo, { commit, files: await describe(dir) });
  }
  const refuse = (res, status, code) => {
    res.writeHead(status, { 'content-type': 'application/json', 'x-error-code': code });
    res.end(JSON.stringify({ error: code }));
  };
  const server = http.createServer((req, res) => {
    const url = new URL(req.url, 'http://hub');
    const parts = url.pathname.split('/').filter(Boolean).map(decodeURIComponent);
    const info = parts[0] === 'api' && parts[1] === 'models' && parts[4] === 'revision' && parts.length === 6;
    const resolve = parts[2] === 'resolve' && parts.length === 5;
    const repoName = info ? `${parts[2]}/${parts[3]}` : `${parts[0]}/${parts[1]}`;
    const repo = served.get(repoName);
    if (!repo) return refuse(res, 401, 'RepoNotFound');
    const rev = info ? parts[5] : parts[3];
    if (rev !== 'main' && rev !== repo.commit) return refuse(res, 404, 'RevisionNotFound');
    if (info) {
      const siblings = [...repo.files].map(([name, f]) => ({
        rfilename: name,
        size: f.size,
        blobId: f.blobId,
        ...(f.sha256 ? { lfs: { sha256: f.sha256, size: f.size, pointerSize: 134 } } : {}),
      }));
      res.writeHead(200, { 'content-type': 'application/json' });
      return res.end(JSON.stringify({ id: repoName, sha: repo.commit, siblings }));
    }
    if (!resolve) return refuse(res, 404, 'EntryNotFound');
    const entry = repo.files.get(parts[4]);
    if (!entry) return refuse(res, 404, 'EntryNotFound');
    const match = /^bytes=(\d+)-$/.exec(req.headers.range || '');
    const start = match ? Number(match[1]) : 0;
    const headers = {
      'x-repo-commit': repo.commit,
      etag: `"${entry.sha256 || entry.blobId}"`,
      'accept-ranges': 'bytes',
      'content-length': String(entry.size - start),
    };
    if (match) headers['content-range'] = `bytes ${start}-${entry.size - 1}/${entry.size}`;
    res.writeHead(match ? 206 : 200, headers);
    createReadStream(entry.file, { start }).pipe(res);
  });
  await new Promise((resolve) => server.listen(0, '127.0.0.1', resolve));
  return {
    url: `http://127.0.0.1:${server.address().port}`,
    stop: () => new Promise((resolve) => server.close(resolve)),
  };
}
