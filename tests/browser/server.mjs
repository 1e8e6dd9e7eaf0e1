// Starts the release binary on a free port with a fresh data directory, and stops it.
import { spawn } from 'node:child_process';
import { existsSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import net from 'node:net';
import { tmpdir } from 'node:os';
import path from 'node:path';

export const repoRoot = path.resolve(import.meta.dirname ?? path.dirname(new URL(import.meta.url).pathname), '..', '..');

function freePort() {
  return new Promise((resolve, reject) => {
    const server = net.createServer();
    server.unref();
    server.on('error', reject);
    server.listen(0, '127.0.0.1', () => {
      const { port } = server.address();
      server.close(() => resolve(port));
    });
  });
}

/**
 * `configToml`, when given, is written to the data directory's sluice.toml, which the server
 * reads at start as an operator's config file.
 */
export async function startServer({ configToml } = {}) {
  const binary = process.env.SLUICE_BIN || path.join(repoRoot, 'target', 'release', 'sluice');
  if (!existsSync(binary)) {
    throw new Error(`${binary} does not exist: build it first with \`cargo build --release\``);
  }
  const dataDir = mkdtempSync(path.join(tmpdir(), 'sluice-e2e-'));
  if (configToml) writeFileSync(path.join(dataDir, 'sluice.toml'), configToml);
  const port = await freePort();
  const url = `http://127.0.0.1:${port}`;
  const log = [];
  const child = spawn(binary, ['serve'], {
    cwd: repoRoot,
    env: { ...process.env, SLUICE_ADDR: `127.0.0.1:${port}`, SLUICE_DATA_DIR: dataDir, RUST_LOG: process.env.RUST_LOG || 'info' },
    stdio: ['ignore', 'pipe', 'pipe'],
  });
  for (const stream of [child.stdout, child.stderr]) {
    stream.setEncoding('utf8');
    stream.on('data', (chunk) => log.push(chunk));
  }
  const exited = new Promise((resolve) => child.on('exit', (code, signal) => resolve({ code, signal })));

  const deadline = Date.now() + 30_000;
  for (;;) {
    const done = await Promise.race([exited, new Promise((r) => setTimeout(() => r(null), 200))]);
    if (done) throw new Error(`the server exited (${JSON.stringify(done)}) before it answered:\n${log.join('')}`);
    try {
      const response = await fetch(`${url}/healthz`);
      if (response.ok) break;
    } catch {
      // not listening yet
    }
    if (Date.now() > deadline) {
      child.kill('SIGKILL');
      throw new Error(`the server did not answer on ${url} within 30 s:\n${log.join('')}`);
    }
  }

  return {
    url,
    dataDir,
    log: () => log.join(''),
    async stop() {
      if (child.exitCode === null && child.signalCode === null) {
        child.kill('SIGTERM');
        const timer = setTimeout(() => child.kill('SIGKILL'), 10_000);
        await exited;
        clearTimeout(timer);
      }
      rmSync(dataDir, { recursive: true, force: true });
    },
  };
}
