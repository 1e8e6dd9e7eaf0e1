#!/usr/bin/env python3
"""End-to-end check of the Sluice appliance on the GPU machine, through its JSON API as the
browser drives it. Normally started by `scripts/gpu/appliance_e2e.sh`, which sets the defaults
below from the environment; it can also be run directly:

    python3 scripts/gpu/appliance_e2e.py [SLUICE_BIN] [OUT_DIR] [--only PARTS] [--skip PARTS]

Parts, in the order they run (`--only` / `--skip` take a comma-separated list):

  bench     `sluice bench train` on E2E_PRESET: the baseline tokens/s (median of steps 3..N)
  api       the same shape as a job through the API: plan, submit, wait, median tokens/s from
            /api/jobs/{id}/metrics, ratio API / bench (>= E2E_MIN_RATIO to pass), placement
  resume    two identical small jobs: A uninterrupted, B killed (kill -9 of the server) after a
            checkpoint, the server restarted, B resumed; the final tensors must match bit for bit
  download  the archive of job A's final checkpoint: a tar with config.json and safetensors
  generate  "try it" on job A's final checkpoint: two chat turns on the free GPU (the second
            streamed, the model kept loaded), then one beside a job training on the GPU (on
            the CPU, saying why)

`download` and `generate` need job A; without `resume` only job A runs.

Everything is written under OUT_DIR: e2e.log (this console), server-N.{stdout,stderr}.log,
bench.{stdout,stderr}.log, bench JSON, api/NN-*.json (each API reply of interest), metrics-*.json,
results.json and summary.txt (both rewritten after every check, so a run killed part-way still
leaves what it measured). The appliance's data directory (several GB of checkpoints) is under
E2E_WORK, not OUT_DIR. Exit status: 0 when no check failed, 1 otherwise, 2 for bad usage.

Only the standard library is needed: safetensors files are compared by parsing their headers
and comparing every tensor's bytes (numpy, when present, only adds a max-difference figure).
"""

import argparse
import ctypes
import http.client
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tarfile
import time
import traceback
import urllib.error
import urllib.request
from pathlib import Path

PARTS = ["bench", "api", "resume", "download", "generate"]
TERMINAL = {"completed", "failed", "cancelled", "interrupted"}
PASSWORD = "e2e-correct-horse-battery"
USERNAME = "e2e-admin"


# ----------------------------------------------------------------------------------------------
# Settings: the shell script exports these; the defaults here are the same.


def env(name, default):
    value = os.environ.get(name, "")
    return value if value != "" else default


def env_int(name, default):
    value = env(name, str(default))
    try:
        return int(value)
    except ValueError:
        sys.exit(f"{name}={value!r}: expected an integer")


def env_float(name, default):
    value = env(name, str(default))
    try:
        return float(value)
    except ValueError:
        sys.exit(f"{name}={value!r}: expected a number")


class Settings:
    def __init__(self):
        self.preset = env("E2E_PRESET", "qwen2.5-7b")
        self.seq_len = env_int("E2E_SEQ_LEN", 1024)
        self.micro_batch = env_int("E2E_MICRO_BATCH", 8)
        self.grad_accum = env_int("E2E_GRAD_ACCUM", 8)
        self.bench_steps = env_int("E2E_BENCH_STEPS", 6)
        self.steps = env_int("E2E_STEPS", 8)
        self.gpu = env("E2E_GPU", "cuda:0")
        self.min_ratio = env_float("E2E_MIN_RATIO", 0.95)
        self.bench_json = env("E2E_BENCH_JSON", "")
        self.api_end = env("E2E_API_END", "auto")

        self.r_preset = env("E2E_RESUME_PRESET", "qwen2.5-0.5b")
        self.r_seq_len = env_int("E2E_RESUME_SEQ_LEN", 256)
        self.r_micro_batch = env_int("E2E_RESUME_MICRO_BATCH", 4)
        self.r_grad_accum = env_int("E2E_RESUME_GRAD_ACCUM", 2)
        self.r_steps = env_int("E2E_RESUME_STEPS", 12)
        self.r_save_every = env_int("E2E_RESUME_SAVE_EVERY", 3)
        self.r_save_dtype = env("E2E_RESUME_SAVE_DTYPE", "f32")
        self.kill_after_checkpoint = env_int("E2E_KILL_AFTER_CHECKPOINT", 3)
        self.kill_at_step = env_int("E2E_KILL_AT_STEP", 5)

        self.prompt = env("E2E_PROMPT", "How much is 107 plus 138?")
        self.max_new_tokens = env_int("E2E_MAX_NEW_TOKENS", 24)

        self.bench_timeout = env_int("E2E_BENCH_TIMEOUT", 1200)
        self.api_timeout = env_int("E2E_API_TIMEOUT", 1200)
        self.save_grace = env_int("E2E_API_SAVE_TIMEOUT", 600)
        self.timeout = env_int("E2E_TIMEOUT", 600)
        self.start_timeout = env_int("E2E_START_TIMEOUT", 180)

        self.work = Path(env("E2E_WORK", "/tmp/sluice-e2e"))
        self.dataset = env("E2E_DATASET", "")
        self.clean = env("E2E_CLEAN", "0") == "1"
        self.rust_log = env("RUST_LOG", "info")

    def as_dict(self):
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(self).items()}


# ----------------------------------------------------------------------------------------------
# Output: console + e2e.log, results.json, summary.txt.


class Failed(Exception):
    """A check failed; the message says why (already recorded by whoever raised it)."""


class ServerDied(Exception):
    pass


class Ctx:
    def __init__(self, out, settings, binary):
        self.out = out
        self.s = settings
        self.bin = binary
        self.t0 = time.time()
        self.log_file = open(out / "e2e.log", "a", buffering=1, encoding="utf-8")
        self.checks = []
        self.figures = {}
        self.reply_seq = 0
        (out / "api").mkdir(exist_ok=True)

    def say(self, text):
        line = f"[{time.time() - self.t0:7.1f}s] {text}"
        print(line, flush=True)
        self.log_file.write(line + "\n")

    def warn(self, text):
        self.say(f"WARN {text}")

    def check(self, name, result, figures="", detail=""):
        """Records a check: PASS, FAIL or SKIP, with its figures; FAIL prints a clear line."""
        self.checks.append({"check": name, "result": result, "figures": figures,
                            "detail": detail, "t": round(time.time() - self.t0, 1)})
        if result == "FAIL":
            self.say(f"FAIL {name}: {figures}" + (f" ({detail})" if detail else ""))
        else:
            self.say(f"{result} {name}: {figures}")
        self.write_results()

    def figure(self, key, value):
        self.figures[key] = value
        self.write_results()

    def failed(self):
        return any(c["result"] == "FAIL" for c in self.checks)

    def save_json(self, name, obj):
        path = self.out / name
        with open(path, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2, default=str)
        return path

    def save_reply(self, name, reply):
        self.reply_seq += 1
        safe = re.sub(r"[^A-Za-z0-9._-]+", "-", name)
        path = self.out / "api" / f"{self.reply_seq:02d}-{safe}.json"
        body = reply.json_or_none()
        record = {"request": f"{reply.method} {reply.path}", "status": reply.status,
                  "elapsed_s": round(reply.elapsed, 3)}
        if body is not None:
            record["body"] = body
        else:
            record["text"] = reply.text()[:20000]
        with open(path, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=2, default=str)

    def table(self):
        rows = [("check", "result", "figures")] + [
            (c["check"], c["result"], c["figures"]) for c in self.checks]
        w0 = max(len(r[0]) for r in rows)
        w1 = max(len(r[1]) for r in rows)
        lines = [f"{r[0]:<{w0}} | {r[1]:<{w1}} | {r[2]}" for r in rows]
        lines.insert(1, "-" * w0 + "-+-" + "-" * w1 + "-+-" + "-" * 40)
        key = [
            ("bench median tok/s", "bench_tokens_per_s"),
            ("API median tok/s", "api_tokens_per_s"),
            ("ratio API/bench", "ratio"),
            ("bench placement", "bench_placement"),
            ("plan placement", "plan_placement"),
            ("API job placement", "api_placement"),
            ("resume bitwise", "resume_bitwise"),
            ("step of the kill", "kill_step"),
            ("last loss A / B", "last_losses"),
            ("download size", "download_size"),
            ("generation time", "generation_time"),
            ("generation device", "generation_device"),
        ]
        lines.append("")
        lines.append("key figures:")
        for label, k in key:
            if k in self.figures:
                lines.append(f"  {label:<20} {fmt_figure(self.figures[k])}")
        verdict = "FAILED" if self.failed() else "PASSED"
        n_fail = sum(c["result"] == "FAIL" for c in self.checks)
        lines.append("")
        lines.append(f"{verdict}: {len(self.checks)} checks, {n_fail} failed, "
                     f"{sum(c['result'] == 'SKIP' for c in self.checks)} skipped, "
                     f"{time.time() - self.t0:.0f} s")
        return "\n".join(lines)

    def write_results(self):
        try:
            self.save_json("results.json", {"settings": self.s.as_dict(), "binary": str(self.bin),
                                            "checks": self.checks, "figures": self.figures})
            with open(self.out / "summary.txt", "w", encoding="utf-8") as f:
                f.write(self.table() + "\n")
        except OSError as e:
            print(f"cannot write results: {e}", file=sys.stderr)


def fmt_figure(v):
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 100 else f"{v:,.0f}"
    if isinstance(v, (dict, list)):
        return json.dumps(v, default=str)
    return str(v)


def gb(n):
    return f"{n / 1e9:.2f} GB"


def median(values):
    v = sorted(values)
    if not v:
        return None
    n = len(v)
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2


def summarize_placement(p):
    """One line for a placement, whatever its shape (engine Placement, string, other)."""
    if p is None:
        return "n/a"
    if isinstance(p, str):
        return p
    if isinstance(p, dict):
        for key in ("description", "describe", "summary"):
            if isinstance(p.get(key), str):
                return p[key]
        parts = []
        if "resident_units" in p or "resident_summary" in p:
            n = len(p.get("resident_units") or [])
            summary = p.get("resident_summary") or ""
            parts.append(f"{n} resident" + (f" ({summary})" if summary else ""))
        elif "resident" in p:
            parts.append(f"{len(p.get('resident') or [])} resident")
        if "checkpoints" in p:
            parts.append(f"checkpoints {p['checkpoints']}"
                         + (f" every {p['checkpoint_interval']}"
                            if "checkpoint_interval" in p else ""))
        if "gradients" in p:
            parts.append(f"gradients {p['gradients']}")
        if parts:
            return ", ".join(parts)
    text = json.dumps(p, default=str)
    return text if len(text) <= 160 else text[:157] + "..."


# ----------------------------------------------------------------------------------------------
# Child processes: die with us (PR_SET_PDEATHSIG), and a pid file so a rerun can stop a
# leftover of a run that was killed outright.

try:
    _LIBC = ctypes.CDLL("libc.so.6", use_errno=True)
except OSError:
    _LIBC = None


def _die_with_parent():
    if _LIBC is not None:
        _LIBC.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


CHILDREN = []


def spawn(cmd, stdout, stderr, env_vars, pidfile):
    proc = subprocess.Popen(cmd, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL,
                            env=env_vars, preexec_fn=_die_with_parent)
    CHILDREN.append(proc)
    try:
        pidfile.write_text(f"{proc.pid}\n{' '.join(map(str, cmd))}\n")
    except OSError:
        pass
    return proc


def stop_leftover(pidfile, ctx):
    """Stops a process a previous run of this script started (named in its pid file)."""
    try:
        pid = int(pidfile.read_text().split()[0])
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except (OSError, ValueError, IndexError):
        return
    if "serve" in cmdline or "bench" in cmdline:
        ctx.warn(f"a process of an earlier run is still alive (pid {pid}: {cmdline.strip()}); "
                 "stopping it")
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
        time.sleep(2)


def kill_children():
    for proc in CHILDREN:
        if proc.poll() is None:
            try:
                proc.terminate()
                proc.wait(15)
            except (OSError, subprocess.TimeoutExpired):
                try:
                    proc.kill()
                except OSError:
                    pass


# ----------------------------------------------------------------------------------------------
# The server process.


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(path, n=40):
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-n:])


def oom_lines():
    """The kernel's OOM-killer lines, when dmesg may be read."""
    try:
        text = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""
    lines = [l for l in text.splitlines()
             if re.search(r"out of memory|oom-kill|killed process", l, re.I)]
    return (" dmesg: " + " | ".join(lines[-3:])) if lines else ""


class Server:
    def __init__(self, ctx, data_dir):
        self.ctx = ctx
        self.data_dir = data_dir
        self.proc = None
        self.n = 0
        self.base = None
        self.pidfile = ctx.s.work / "server.pid"
        self.killed_by_us = False

    def start(self):
        self.n += 1
        self.killed_by_us = False
        port = free_port()
        self.base = f"http://127.0.0.1:{port}"
        self.stdout_path = self.ctx.out / f"server-{self.n}.stdout.log"
        self.stderr_path = self.ctx.out / f"server-{self.n}.stderr.log"
        cmd = [str(self.ctx.bin), "serve", "--addr", f"127.0.0.1:{port}",
               "--data-dir", str(self.data_dir)]
        env_vars = dict(os.environ)
        env_vars["RUST_LOG"] = self.ctx.s.rust_log
        self.ctx.say(f"starting the server #{self.n}: {' '.join(cmd)}")
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.proc = spawn(cmd, out, err, env_vars, self.pidfile)
        deadline = time.time() + self.ctx.s.start_timeout
        last = ""
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise ServerDied(f"the server exited with status {self.proc.returncode} while "
                                 f"starting; stderr:\n{tail(self.stderr_path)}")
            try:
                with OPENER.open(self.base + "/healthz", timeout=3) as r:
                    body = r.read().decode(errors="replace")
                    if r.status == 200:
                        self.ctx.say(f"server #{self.n} up at {self.base}: {body.strip()}")
                        return body
                    last = f"{r.status} {body}"
            except urllib.error.HTTPError as e:
                last = f"{e.code} {e.read()[:300]!r}"
            except (OSError, http.client.HTTPException) as e:
                last = str(e)
            time.sleep(0.5)
        raise ServerDied(f"the server did not answer /healthz in {self.ctx.s.start_timeout} s "
                         f"(last: {last}); stderr:\n{tail(self.stderr_path)}")

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def check(self):
        if self.proc is not None and self.proc.poll() is not None:
            rc = self.proc.returncode
            how = f"signal {-rc}" if rc < 0 else f"status {rc}"
            hint = ""
            if rc == -9 and not self.killed_by_us:
                hint = ", SIGKILL: the kernel's OOM killer?" + oom_lines()
            raise ServerDied(f"the server #{self.n} exited ({how}{hint}); see "
                             f"{self.stderr_path.name}; its tail:\n{tail(self.stderr_path, 15)}")

    def kill9(self):
        if not self.alive():
            return
        self.ctx.say(f"kill -9 {self.proc.pid} (server #{self.n})")
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(60)
        self.killed_by_us = True

    def stop(self):
        if not self.alive():
            return
        self.ctx.say(f"stopping the server #{self.n} (SIGTERM)")
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.ctx.warn("the server did not stop in 30 s: SIGKILL")
            self.proc.kill()
            self.proc.wait(30)

    def ensure(self):
        if not self.alive():
            if self.proc is not None and not self.killed_by_us:
                self.ctx.warn(f"the server #{self.n} is gone (status {self.proc.returncode}); "
                              "starting it again")
            self.start()


# ----------------------------------------------------------------------------------------------
# The API client: cookie and CSRF header as the browser sends them.

# No proxies: a proxy variable in the environment must not capture requests to 127.0.0.1.
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class Reply:
    def __init__(self, method, path, status, headers, body, elapsed):
        self.method, self.path, self.status = method, path, status
        self.headers, self.body, self.elapsed = headers, body, elapsed

    def text(self):
        return self.body.decode("utf-8", errors="replace")

    def json_or_none(self):
        try:
            return json.loads(self.body)
        except (ValueError, TypeError):
            return None

    def json(self):
        value = self.json_or_none()
        if value is None:
            raise Failed(f"{self.method} {self.path}: status {self.status}, not JSON: "
                         f"{self.text()[:4000]}")
        return value

    def describe(self):
        return f"{self.method} {self.path} -> {self.status}: {self.text()[:4000]}"


class Api:
    def __init__(self, ctx, server):
        self.ctx, self.server = ctx, server
        self.cookie = None
        self.csrf = None

    def call(self, method, path, body=None, raw=None, content_type=None, timeout=120,
             expect=None, name=None, stream_to=None, relogin=True):
        url = self.server.base + path
        headers = {"Accept": "application/json"}
        if self.cookie:
            headers["Cookie"] = f"sluice_session={self.cookie}"
        if method not in ("GET", "HEAD") and self.csrf:
            headers["X-CSRF-Token"] = self.csrf
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        elif raw is not None:
            data = raw
            headers["Content-Type"] = content_type
        request = urllib.request.Request(url, data=data, method=method, headers=headers)
        started = time.time()
        try:
            try:
                resp = OPENER.open(request, timeout=timeout)
            except urllib.error.HTTPError as e:
                resp = e
            status = resp.status if hasattr(resp, "status") else resp.code
            try:
                self._take_cookie(resp.headers)
                if stream_to is not None and 200 <= status < 300:
                    size = 0
                    with open(stream_to, "wb") as f:
                        while True:
                            chunk = resp.read(1 << 20)
                            if not chunk:
                                break
                            f.write(chunk)
                            size += len(chunk)
                    payload = json.dumps({"streamed_to": str(stream_to), "bytes": size}).encode()
                else:
                    payload = resp.read()
            finally:
                resp.close()
        except (OSError, http.client.HTTPException) as e:
            self.server.check()
            raise Failed(f"{method} {path}: no reply after {time.time() - started:.1f} s: "
                         f"{type(e).__name__}: {e}")
        reply = Reply(method, path, status, resp.headers, payload, time.time() - started)
        if (status == 401 and relogin and self.ctx_can_relogin(path)):
            self.ctx.warn(f"{method} {path}: 401; logging in again")
            self.login()
            return self.call(method, path, body, raw, content_type, timeout, expect, name,
                             stream_to, relogin=False)
        if name:
            self.ctx.save_reply(name, reply)
        if expect is not None and status not in expect:
            raise Failed(reply.describe())
        return reply

    @staticmethod
    def ctx_can_relogin(path):
        return path not in ("/api/login", "/api/setup", "/api/session")

    def _take_cookie(self, headers):
        for value in headers.get_all("Set-Cookie") or []:
            m = re.match(r"\s*sluice_session=([^;]*)", value)
            if m:
                self.cookie = m.group(1) or None

    def _adopt(self, reply):
        session = reply.json()
        if session.get("csrf"):
            self.csrf = session["csrf"]
        return session

    def login(self):
        """Setup on a fresh appliance, else login; leaves the cookie and CSRF token set."""
        session = self._adopt(self.call("GET", "/api/session", expect=[200], relogin=False))
        creds = {"username": USERNAME, "password": PASSWORD}
        if session.get("setup_needed"):
            reply = self.call("POST", "/api/setup", creds, name="setup", relogin=False)
            if reply.status != 200:
                raise Failed(reply.describe())
            session = self._adopt(reply)
        elif not session.get("user"):
            reply = self.call("POST", "/api/login", creds, name="login", relogin=False)
            if reply.status != 200:
                raise Failed(reply.describe())
            session = self._adopt(reply)
        user = session.get("user") or {}
        if not user:
            raise Failed(f"no user after setup/login: {session}")
        return user

    def get_json(self, path, name=None, timeout=120):
        return self.call("GET", path, expect=[200], name=name, timeout=timeout).json()

    def post_tolerant(self, path, body, name):
        """POST, and if the server refuses a field of the new job contract as unknown (an
        older server), say so and retry without it. Returns the reply and the body sent."""
        body = dict(body)
        for _ in range(len(body)):
            reply = self.call("POST", path, body, name=name)
            if reply.status in (400, 422):
                m = re.search(r"unknown field `([^`]+)`", reply.text())
                if m and m.group(1) in body:
                    self.ctx.warn(f"POST {path} refused the field {m.group(1)!r} (a server "
                                  f"older than the job contract?): {reply.text()[:300]}; "
                                  "retrying without it")
                    body.pop(m.group(1))
                    continue
            return reply, body
        return reply, body

    def upload(self, path, file_path, name):
        boundary = "sluice-e2e-boundary-7f3a9c"
        data = bytearray()
        data += (f"--{boundary}\r\nContent-Disposition: form-data; name=\"name\"\r\n\r\n"
                 f"{name}\r\n").encode()
        data += (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; "
                 f"filename=\"{Path(file_path).name}\"\r\n"
                 "Content-Type: application/octet-stream\r\n\r\n").encode()
        data += Path(file_path).read_bytes()
        data += f"\r\n--{boundary}--\r\n".encode()
        return self.call("POST", path, raw=bytes(data),
                         content_type=f"multipart/form-data; boundary={boundary}",
                         name="dataset-upload", timeout=300)

    # Jobs ------------------------------------------------------------------------------------

    def job(self, job_id):
        return self.get_json(f"/api/jobs/{job_id}")

    def metrics(self, job_id, name=None):
        points = self.get_json(f"/api/jobs/{job_id}/metrics", timeout=300)
        if name:
            self.ctx.save_json(name, points)
        return points

    def save_log(self, job_id, label):
        try:
            reply = self.call("GET", f"/api/jobs/{job_id}/log")
            (self.ctx.out / f"job-{label}-{job_id}.log").write_text(reply.text())
            return reply.text()
        except (Failed, ServerDied) as e:
            return f"(no log: {e})"

    def submit(self, body, label):
        reply, sent = self.post_tolerant("/api/jobs", body, f"job-submit-{label}")
        if reply.status not in (200, 201):
            raise Failed(reply.describe())
        job_id = reply.json().get("id")
        if not isinstance(job_id, int):
            raise Failed(f"no job id in {reply.text()[:2000]}")
        self.ctx.say(f"job {label}: id {job_id}, body {json.dumps(sent)}")
        return job_id

    def wait_job(self, job_id, label, timeout, until=None, interval=2.0, on_poll=None):
        """Polls the job until `until(job)` (default: a terminal status); raises Failed on the
        timeout, ServerDied when the server goes away."""
        until = until or (lambda j: j.get("status") in TERMINAL)
        deadline = time.time() + timeout
        last_state = None
        last_print = 0.0
        while True:
            self.server.check()
            job = self.job(job_id)
            state = (job.get("status"), job.get("step"))
            now = time.time()
            if state != last_state or now - last_print > 60:
                eta = job.get("eta_s")
                self.ctx.say(f"job {label} ({job_id}): {job.get('status')} step "
                             f"{job.get('step')}/{job.get('total_steps')}"
                             + (f", eta {eta:.0f} s" if isinstance(eta, (int, float)) else ""))
                last_state, last_print = state, now
            if on_poll is not None:
                result = on_poll(job)
                if result is not None:
                    return result
            if until(job):
                return job
            if now > deadline:
                log = self.save_log(job_id, label)
                raise Failed(f"job {label} ({job_id}) did not get there in {timeout} s; last "
                             f"state {json.dumps(job)[:3000]}; log tail:\n"
                             + "\n".join(log.splitlines()[-30:]))
            time.sleep(interval)


def job_body(model, dataset, gpu, **settings):
    body = {"model": model, "dataset": dataset, "gpu": gpu}
    body.update({k: v for k, v in settings.items() if v is not None})
    return body


def points_by_step(points):
    return {p["step"]: p for p in points if isinstance(p, dict) and "step" in p}


def steady_median(points, key="tokens_per_s", first=3):
    """Median of `key` over steps first..N (all steps when there are fewer)."""
    by_step = points_by_step(points)
    steady = [p.get(key) for s, p in sorted(by_step.items()) if s >= first]
    steady = [v for v in steady if isinstance(v, (int, float))]
    if not steady:
        steady = [p.get(key) for p in by_step.values() if isinstance(p.get(key), (int, float))]
    return median(steady), len(steady)


# ----------------------------------------------------------------------------------------------
# Safetensors, compared without libraries: same tensors, dtypes, shapes, and equal bytes.


def safetensors_index(folder):
    """{tensor name: (dtype, shape, file, start, end)} over every *.safetensors in `folder`."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise Failed(f"no .safetensors file in {folder} (it holds: "
                     f"{sorted(p.name for p in Path(folder).iterdir()) if Path(folder).is_dir() else 'nothing, it does not exist'})")
    index = {}
    for path in files:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise Failed(f"{path}: too short for a safetensors header")
            (n,) = struct.unpack("<Q", raw)
            if n > 100 << 20:
                raise Failed(f"{path}: header of {n} bytes is not plausible")
            header = json.loads(f.read(n))
        base = 8 + n
        size = path.stat().st_size
        for name, info in header.items():
            if name == "__metadata__":
                continue
            start, end = info["data_offsets"]
            if base + end > size:
                raise Failed(f"{path}: tensor {name} runs past the end of the file")
            if name in index:
                raise Failed(f"{folder}: tensor {name} is in two files")
            index[name] = (info["dtype"], tuple(info["shape"]), path, base + start, base + end)
    return index


def ranges_equal(a_path, a_start, b_path, b_start, length, fa, fb):
    fa.seek(a_start)
    fb.seek(b_start)
    left = length
    while left > 0:
        n = min(left, 16 << 20)
        if fa.read(n) != fb.read(n):
            return False
        left -= n
    return True


def max_abs_diff(a, b):
    """Largest difference of two f32 tensors, when numpy is there (a figure only)."""
    try:
        import numpy as np
    except ImportError:
        return None
    (dtype, _, pa, sa, ea), (_, _, pb, sb, eb) = a, b
    if dtype != "F32":
        return None
    with open(pa, "rb") as f:
        f.seek(sa)
        x = np.frombuffer(f.read(ea - sa), dtype="<f4")
    with open(pb, "rb") as f:
        f.seek(sb)
        y = np.frombuffer(f.read(eb - sb), dtype="<f4")
    return float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64))))


def compare_folders(a_dir, b_dir):
    """Returns (equal, summary, details) for the safetensors of two folders."""
    a, b = safetensors_index(a_dir), safetensors_index(b_dir)
    if set(a) != set(b):
        only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
        return False, f"different tensor names: only in A {only_a[:5]}, only in B {only_b[:5]}", {}
    mismatched, meta = [], []
    total = 0
    handles = {}
    try:
        for name in sorted(a):
            da, sha, pa, sa, ea = a[name]
            db, shb, pb, sb, eb = b[name]
            if (da, sha) != (db, shb):
                meta.append(f"{name}: {da}{list(sha)} vs {db}{list(shb)}")
                continue
            if ea - sa != eb - sb:
                meta.append(f"{name}: {ea - sa} vs {eb - sb} bytes")
                continue
            for p in (pa, pb):
                if p not in handles:
                    handles[p] = open(p, "rb")
            total += ea - sa
            if not ranges_equal(pa, sa, pb, sb, ea - sa, handles[pa], handles[pb]):
                mismatched.append(name)
    finally:
        for h in handles.values():
            h.close()
    details = {"tensors": len(a), "bytes": total, "mismatched": mismatched[:50],
               "mismatched_count": len(mismatched), "shape_or_dtype": meta[:50]}
    if meta:
        return False, f"{len(meta)} tensors differ in dtype/shape (e.g. {meta[0]})", details
    if mismatched:
        diff = max_abs_diff(a[mismatched[0]], b[mismatched[0]])
        details["first_max_abs_diff"] = diff
        return False, (f"{len(mismatched)} of {len(a)} tensors differ (e.g. {mismatched[0]}"
                       + (f", max |diff| {diff:.3g}" if diff is not None else "") + ")"), details
    dtypes = sorted({v[0] for v in a.values()})
    return True, f"{len(a)} tensors, {gb(total)} ({'/'.join(dtypes)}) equal bit for bit", details


# ----------------------------------------------------------------------------------------------
# The parts.


def phase_bench(ctx):
    s = ctx.s
    json_path = ctx.out / bench_json_name(s.preset)
    device = bench_device(s.gpu)
    if json_path.exists():
        json_path.unlink()
    cmd = [str(ctx.bin), "bench", "train", "--preset", s.preset, "--seq-len", str(s.seq_len),
           "--micro-batch", str(s.micro_batch), "--grad-accum", str(s.grad_accum),
           "--steps", str(s.bench_steps), "--device", device, "--json", str(json_path)]
    ctx.say("bench: " + " ".join(cmd))
    started = time.time()
    with open(ctx.out / "bench.stdout.log", "wb") as out, \
            open(ctx.out / "bench.stderr.log", "wb") as err:
        proc = spawn(cmd, out, err, dict(os.environ), s.work / "bench.pid")
        try:
            rc = proc.wait(s.bench_timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
            ctx.check("bench", "FAIL", f"no result in {s.bench_timeout} s",
                      tail(ctx.out / "bench.stdout.log", 20))
            return None
    elapsed = time.time() - started
    ctx.say("bench stdout tail:\n" + tail(ctx.out / "bench.stdout.log", 14))
    if rc != 0:
        ctx.say("bench stderr tail:\n" + tail(ctx.out / "bench.stderr.log", 30))
        ctx.check("bench", "FAIL", f"exit status {rc} after {elapsed:.0f} s",
                  "see bench.stdout.log / bench.stderr.log")
        return None
    # A copy outside OUT, for a later `--skip-bench` run on the same (warm) machine.
    try:
        shutil.copyfile(json_path, s.work / json_path.name)
    except OSError as e:
        ctx.warn(f"cannot keep a copy of {json_path} in {s.work}: {e}")
    return read_bench(ctx, json_path, elapsed)


def bench_json_name(preset):
    return "bench7b.json" if preset == "qwen2.5-7b" else f"bench-{preset}.json"


def gpu_members(gpu):
    """The single devices of a job's "gpu": cpu, cuda (GPU 0), cuda:N or cuda:N,M,..."""
    if gpu.strip() == "cpu":
        return ["cpu"]
    rest = re.sub(r"^\s*cuda:?", "", gpu)
    ordinals = [n.strip() for n in rest.split(",") if n.strip()] or ["0"]
    return [f"cuda:{n}" for n in ordinals]


def bench_device(gpu):
    """`sluice bench train` runs on one device: the job's first."""
    return gpu_members(gpu)[0]


def read_bench(ctx, json_path, elapsed=None, skipped=False):
    try:
        report = json.loads(Path(json_path).read_text())
    except (OSError, ValueError) as e:
        ctx.check("bench", "FAIL", f"cannot read {json_path}: {e}")
        return None
    summary = report.get("summary") or {}
    steps = report.get("steps") or []
    own, n = steady_median(steps)
    tps = summary.get("tokens_per_s")
    if not isinstance(tps, (int, float)):
        tps = own
    if not isinstance(tps, (int, float)) or tps <= 0:
        ctx.check("bench", "FAIL", f"no tokens_per_s in {json_path}")
        return None
    placement = (report.get("plan") or {}).get("placement")
    ctx.figure("bench_tokens_per_s", tps)
    ctx.figure("bench_placement", summarize_placement(placement))
    ctx.figure("bench_device", report.get("device"))
    figures = (f"median {tps:,.0f} tok/s over steps {summary.get('steps', '?')}"
               f", {summary.get('model_tflops', float('nan')):.1f} TFLOPS"
               f", {summary.get('step_s', float('nan')):.2f} s/step"
               f", device {report.get('device')}"
               f", placement {summarize_placement(placement)}")
    if summary.get("peak_rss_bytes"):
        figures += f", peak RSS {gb(summary['peak_rss_bytes'])}"
    if own is not None and abs(own - tps) > 1e-6 * tps:
        figures += f" (own median of steps 3..N: {own:,.0f})"
    if skipped:
        ctx.check("bench", "SKIP", f"not run; figures from {json_path}: {figures}")
    else:
        ctx.check("bench", "PASS", figures + (f", {elapsed:.0f} s in all" if elapsed else ""))
    return tps


def phase_dataset(ctx, api):
    s = ctx.s
    listed = api.get_json("/api/datasets", name="datasets")
    repo = Path(__file__).resolve().parents[2]
    path = Path(s.dataset) if s.dataset else repo / "datasets" / "demo-alpaca.jsonl"
    if path.is_file():
        reply = api.upload("/api/datasets", path, "e2e-" + path.stem)
        if reply.status in (200, 201):
            d = reply.json()
            ctx.check("dataset upload", "PASS", f"{path.name} as id {d.get('id')}: "
                      f"{d.get('records')} {d.get('format')} records, {d.get('size_bytes')} bytes")
            return d["id"]
        ctx.check("dataset upload", "FAIL", f"status {reply.status}", reply.text()[:2000])
    else:
        ctx.warn(f"no dataset file at {path}: using the pre-registered demo")
    demo = [d for d in listed if d.get("name") == "demo-alpaca"] or listed
    if not demo:
        raise Failed(f"no dataset to train on: GET /api/datasets answered {listed}")
    ctx.say(f"using dataset {demo[0].get('id')} ({demo[0].get('name')})")
    return demo[0]["id"]


def model_params(ctx, api, model_id):
    try:
        for m in api.get_json("/api/models", name="models"):
            if m.get("id") == model_id:
                return m.get("params")
    except Failed as e:
        ctx.warn(f"GET /api/models: {e}")
    return None


def meminfo():
    info = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            k, v = line.split(":", 1)
            info[k] = int(v.split()[0]) * 1024
    except (OSError, ValueError):
        pass
    return info


def phase_api(ctx, server, api, dataset, bench_tps):
    s = ctx.s
    model = f"preset:{s.preset}"
    body = job_body(model, dataset, s.gpu, seq_len=s.seq_len, micro_batch=s.micro_batch,
                    grad_accum=s.grad_accum, steps=s.steps)

    # What the end of the job needs: the final checkpoint plus the resumable f32 state
    # (master weights and both Adam moments). If the disk cannot hold it, the job cannot
    # complete here, and waiting for it only fills the disk the next parts need.
    params = model_params(ctx, api, model)
    free = shutil.disk_usage(server.data_dir).free
    end_mode = s.api_end
    need = None
    if isinstance(params, int) and params > 0:
        need = params * (12 + 2)  # state f32 x3, final checkpoint bf16 (the default)
        mem = meminfo()
        ctx.say(f"{model}: {params / 1e9:.2f}B parameters; the end of the job writes about "
                f"{gb(need)} (state {gb(params * 12)} + final {gb(params * 2)}); disk free "
                f"{gb(free)}; host memory {gb(mem.get('MemTotal', 0))} total, "
                f"{gb(mem.get('MemAvailable', 0))} available")
    if end_mode == "auto":
        end_mode = "kill" if need is not None and need > 0.95 * free else "wait"
        if end_mode == "kill":
            ctx.warn(f"the final save needs ~{gb(need)} of disk and {gb(free)} is free: the job "
                     "cannot complete on this machine; its throughput is measured from the "
                     f"metrics and the server is killed once step {s.steps} is stored "
                     "(E2E_API_END=wait to wait anyway; a host with more disk, e.g. the "
                     "2-GPU kind, can complete it)")

    # The plan, as the new-job form asks it.
    reply, _ = api.post_tolerant("/api/plan", body, "plan")
    plan = reply.json_or_none() if reply.status == 200 else None
    if plan is None:
        ctx.check("plan", "FAIL", f"status {reply.status}", reply.text()[:2000])
    else:
        ctx.figure("plan_placement", summarize_placement(plan.get("placement")))
        ctx.figure("plan", {k: plan.get(k) for k in ("fits", "reason", "step_time_s",
                                                      "bottleneck", "placement", "command")})
        step_time = plan.get("step_time_s")
        figures = (f"fits={plan.get('fits')}, step_time_s="
                   f"{step_time if step_time is None else round(step_time, 3)}, bottleneck "
                   f"{plan.get('bottleneck')}, placement "
                   f"{summarize_placement(plan.get('placement'))}")
        if plan.get("fits") is True:
            ctx.check("plan", "PASS", figures)
        else:
            ctx.check("plan", "FAIL", figures, f"reason: {plan.get('reason')}")

    try:
        job_id = api.submit(body, "throughput")
    except Failed as e:
        ctx.check("api throughput", "FAIL", "the job was not accepted", str(e))
        return
    submitted = time.time()

    points = []
    state = {"last_fetch": 0.0}

    def on_poll(job):
        # Keep the metrics current, so a server that dies at the end still leaves them.
        behind = (job.get("step") or 0) > max(points_by_step(points) or [0])
        if time.time() - state["last_fetch"] > 10 or job.get("status") in TERMINAL or \
                (behind and (job.get("step") or 0) >= s.steps):
            state["last_fetch"] = time.time()
            try:
                points[:] = api.metrics(job_id)
            except Failed as e:
                ctx.warn(f"metrics: {e}")
        if job.get("status") == "running" and max(points_by_step(points) or [0]) >= s.steps:
            if end_mode == "kill":
                return job
            # Every step is stored: what is left is the final save, which gets its own bound.
            state.setdefault("all_steps_at", time.time())
            if time.time() - state["all_steps_at"] > s.save_grace:
                state["stop_reason"] = (f"still saving {s.save_grace} s after its last step "
                                        "(E2E_API_SAVE_TIMEOUT): the script killed the server")
                ctx.warn(f"the job is {state['stop_reason']}")
                return job
        return None

    job, died = None, None
    try:
        job = api.wait_job(job_id, "throughput", s.api_timeout, on_poll=on_poll, interval=3)
    except ServerDied as e:
        died = str(e)
        ctx.warn(f"during the throughput job: {died}")
    except Failed as e:
        state["stop_reason"] = f"no end within E2E_API_TIMEOUT={s.api_timeout} s"
        ctx.warn(str(e))

    # Any job still running blocks the GPU's queue: restart the server (it becomes
    # interrupted). A dead server is restarted too, to read what it stored.
    stopped_by_us = False
    if server.alive():
        current = safe_job(api, job_id)
        if current is not None and current.get("status") not in TERMINAL:
            if end_mode == "kill" and max(points_by_step(points) or [0]) >= s.steps:
                stopped_by_us = True
            else:
                ctx.warn(f"the throughput job is still {current.get('status')}: stopping it")
            server.kill9()
            # Let the save's partial files go before the next part starts.
            time.sleep(2)
    server.ensure()
    api.login()
    final = safe_job(api, job_id, name="job-throughput-final") or job or {}
    try:
        points = api.metrics(job_id, name=f"metrics-throughput-job{job_id}.json")
    except Failed as e:
        ctx.warn(f"metrics after the job: {e}")
        ctx.save_json(f"metrics-throughput-job{job_id}.json", points)
    api.save_log(job_id, "throughput")
    elapsed = time.time() - submitted

    placement = final.get("placement")
    ctx.figure("api_placement", summarize_placement(placement))
    ctx.figure("api_job", {k: final.get(k) for k in ("id", "status", "step", "total_steps",
                                                      "placement", "disk_bytes", "error")})
    tps, n = steady_median(points)
    steps_seen = sorted(points_by_step(points))
    if tps is None:
        ctx.check("api throughput", "FAIL", f"no metric points (status {final.get('status')})",
                  f"error: {final.get('error')}; {died or ''}")
    else:
        ctx.figure("api_tokens_per_s", tps)
        tflops, _ = steady_median(points, "tflops")
        step_s, _ = steady_median(points, "step_s")
        figures = (f"median {tps:,.0f} tok/s over {n} steps (>= 3 of {steps_seen[-1]})"
                   + (f", {tflops:.1f} TFLOPS" if tflops else "")
                   + (f", {step_s:.2f} s/step" if step_s else "")
                   + f", placement {summarize_placement(placement)}")
        if bench_tps:
            ratio = tps / bench_tps
            ctx.figure("ratio", round(ratio, 4))
            figures += f"; bench {bench_tps:,.0f} tok/s; ratio {ratio:.3f} (need >= {s.min_ratio})"
            ctx.check("api throughput", "PASS" if ratio >= s.min_ratio else "FAIL", figures)
        else:
            ctx.check("api throughput", "SKIP", figures + "; no bench baseline to compare with")
        if steps_seen[-1] < s.steps:
            ctx.warn(f"only steps {steps_seen[:1]}..{steps_seen[-1]} of {s.steps} were stored")

    status = final.get("status")
    figures = (f"status {status} at step {final.get('step')}/{final.get('total_steps')} after "
               f"{elapsed:.0f} s; disk_bytes {final.get('disk_bytes')}")
    if status == "completed":
        ctx.check("api job completes", "PASS", figures)
    elif stopped_by_us:
        ctx.check("api job completes", "SKIP",
                  f"killed with the server after step {s.steps} was stored (now {status}): "
                  f"the final save needs ~{gb(need)}, {gb(free)} of disk free")
    else:
        ctx.check("api job completes", "FAIL", figures,
                  (f"{state['stop_reason']}; " if "stop_reason" in state else "")
                  + f"error: {final.get('error')}"
                  + (f"; {died.splitlines()[0]}" if died else ""))
    # The run folder of a large model takes most of the disk the next parts need.
    run_dir = server.data_dir / "runs" / str(job_id)
    if run_dir.exists():
        try:
            size = sum(p.stat().st_size for p in run_dir.rglob("*") if p.is_file())
        except OSError:
            size = 0
        ctx.say(f"removing {run_dir} ({gb(size)}) to free the disk")
        shutil.rmtree(run_dir, ignore_errors=True)


def safe_job(api, job_id, name=None):
    try:
        reply = api.call("GET", f"/api/jobs/{job_id}", expect=[200], name=name)
        return reply.json()
    except (Failed, ServerDied) as e:
        api.ctx.warn(f"GET /api/jobs/{job_id}: {e}")
        return None


def resume_body(ctx, dataset):
    s = ctx.s
    return job_body(f"preset:{s.r_preset}", dataset, s.gpu, seq_len=s.r_seq_len,
                    micro_batch=s.r_micro_batch, grad_accum=s.r_grad_accum, steps=s.r_steps,
                    save_every=s.r_save_every, save_dtype=s.r_save_dtype)


def run_job_a(ctx, server, api, dataset):
    """Job A: the small job uninterrupted. Returns (id, points) or None."""
    s = ctx.s
    body = resume_body(ctx, dataset)
    try:
        job_id = api.submit(body, "A")
        started = time.time()
        job = api.wait_job(job_id, "A", s.timeout)
    except (Failed, ServerDied) as e:
        ctx.check("job A completes", "FAIL", "job A did not complete", str(e))
        return None
    points = api.metrics(job_id, name=f"metrics-A-job{job_id}.json")
    api.save_log(job_id, "A")
    safe_job(api, job_id, name="job-A-final")
    losses = [p.get("loss") for _, p in sorted(points_by_step(points).items())]
    figures = (f"id {job_id}, status {job.get('status')}, step {job.get('step')}/"
               f"{job.get('total_steps')}, {time.time() - started:.0f} s, loss "
               f"{fmt_loss(losses[0] if losses else None)} -> "
               f"{fmt_loss(losses[-1] if losses else None)}, placement "
               f"{summarize_placement(job.get('placement'))}")
    if job.get("status") != "completed":
        ctx.check("job A completes", "FAIL", figures, f"error: {job.get('error')}")
        return None
    ctx.check("job A completes", "PASS", figures)
    return job_id, points


def fmt_loss(v):
    return f"{v:.6f}" if isinstance(v, (int, float)) else str(v)


def checkpoint_steps(api, job_id):
    try:
        listed = api.call("GET", f"/api/jobs/{job_id}/checkpoints", expect=[200]).json()
    except Failed:
        return []
    return [c for c in listed if isinstance(c, dict)]


def phase_resume(ctx, server, api, dataset, a_id, a_points):
    s = ctx.s
    body = resume_body(ctx, dataset)
    try:
        b_id = api.submit(body, "B")
    except Failed as e:
        ctx.check("resume: kill", "FAIL", "job B was not accepted", str(e))
        return
    seen = {"ckpts": []}

    def ready(job):
        if job.get("status") in TERMINAL:
            return job
        step = job.get("step") or 0
        if step < s.kill_at_step:
            return None
        seen["ckpts"] = checkpoint_steps(api, b_id)
        saved = [c.get("step") or 0 for c in seen["ckpts"]]
        if saved and max(saved) >= s.kill_after_checkpoint:
            return job
        return None

    try:
        job = api.wait_job(b_id, "B", s.timeout, on_poll=ready, interval=0.2)
    except (Failed, ServerDied) as e:
        ctx.check("resume: kill", "FAIL", "job B never reached the kill point", str(e))
        return
    if job.get("status") in TERMINAL:
        ctx.check("resume: kill", "FAIL", f"job B ended ({job.get('status')}, step "
                  f"{job.get('step')}) before it had a checkpoint >= "
                  f"{s.kill_after_checkpoint} and step >= {s.kill_at_step}",
                  f"error: {job.get('error')}; checkpoints {seen['ckpts']}")
        return
    server.kill9()
    kill_step = job.get("step")
    ckpt_names = [c.get("name") for c in seen["ckpts"]]
    ctx.save_json("job-B-at-kill.json", {"job": job, "checkpoints": seen["ckpts"]})

    try:
        server.start()
        api.login()
        after = api.get_json(f"/api/jobs/{b_id}", name="job-B-after-restart")
    except (Failed, ServerDied) as e:
        ctx.check("resume: kill", "FAIL", "the server did not come back after kill -9", str(e))
        return
    # The last step polled before the kill, and the last one the server had stored.
    stored = after.get("step")
    if isinstance(stored, int) and isinstance(kill_step, int) and stored > kill_step:
        kill_step = stored
    ctx.figure("kill_step", kill_step)
    ctx.check("resume: kill", "PASS", f"job B ({b_id}) killed with the server at step "
              f"{kill_step}/{job.get('total_steps')} (last polled {job.get('step')}, stored "
              f"{stored}); checkpoints then: {ckpt_names}")
    if after.get("status") == "interrupted":
        ctx.check("resume: interrupted", "PASS", f"job B is interrupted at step "
                  f"{after.get('step')}, resumable={after.get('resumable')}")
    else:
        ctx.check("resume: interrupted", "FAIL", f"job B is {after.get('status')} after the "
                  "restart, not interrupted", json.dumps(after)[:2000])
    try:
        api.metrics(b_id, name=f"metrics-B-before-resume-job{b_id}.json")
    except Failed as e:
        ctx.warn(f"metrics of B before the resume: {e}")

    reply = api.call("POST", f"/api/jobs/{b_id}/resume", name="job-B-resume")
    if reply.status != 200:
        ctx.check("resume: exact", "FAIL", f"resume refused: status {reply.status}",
                  reply.text()[:2000])
        return
    resumed = reply.json()
    ctx.say(f"job B resumed: status {resumed.get('status')}, step {resumed.get('step')}")
    try:
        started = time.time()
        final = api.wait_job(b_id, "B", s.timeout)
    except (Failed, ServerDied) as e:
        ctx.check("resume: exact", "FAIL", "job B did not finish after the resume", str(e))
        return
    log = api.save_log(b_id, "B")
    b_points = api.metrics(b_id, name=f"metrics-B-job{b_id}.json")
    if final.get("status") != "completed":
        ctx.check("resume: exact", "FAIL", f"job B ended {final.get('status')} after the "
                  f"resume", f"error: {final.get('error')}; log tail:\n"
                  + "\n".join(log.splitlines()[-20:]))
        return
    ctx.say(f"job B completed {time.time() - started:.0f} s after the resume")

    # Losses, step by step (exact resume gives the same numbers, and JSON keeps f64 exactly).
    la = {k: p.get("loss") for k, p in points_by_step(a_points).items()}
    lb = {k: p.get("loss") for k, p in points_by_step(b_points).items()}
    last_a = la[max(la)] if la else None
    last_b = lb[max(lb)] if lb else None
    ctx.figure("last_losses", f"{fmt_loss(last_a)} / {fmt_loss(last_b)}")
    ctx.say(f"last loss: A {fmt_loss(last_a)} (step {max(la) if la else '?'}), "
            f"B {fmt_loss(last_b)} (step {max(lb) if lb else '?'})")
    differing = [k for k in sorted(set(la) | set(lb)) if la.get(k) != lb.get(k)]
    loss_figures = (f"{len(la)} steps of A, {len(lb)} of B; last loss A {fmt_loss(last_a)}, "
                    f"B {fmt_loss(last_b)}")
    if differing:
        ctx.check("resume: losses", "FAIL", loss_figures, "steps that differ: "
                  + ", ".join(f"{k}: {la.get(k)} vs {lb.get(k)}" for k in differing[:6]))
    else:
        ctx.check("resume: losses", "PASS", loss_figures + ", every step equal")

    runs = server.data_dir / "runs"
    try:
        equal, summary, details = compare_folders(runs / str(a_id) / "final",
                                                  runs / str(b_id) / "final")
    except (Failed, OSError, ValueError, KeyError) as e:
        equal, summary, details = False, f"cannot compare: {e}", {}
    ctx.save_json("resume-compare-final.json", details)
    ctx.figure("resume_bitwise", "yes" if equal else "no")
    ctx.check("resume: exact", "PASS" if equal else "FAIL",
              f"final/*.safetensors of A ({a_id}) and B ({b_id}): {summary}; killed at step "
              f"{kill_step}; last loss A {fmt_loss(last_a)}, B {fmt_loss(last_b)}")

    # The resumable state (master weights and Adam moments) should match too.
    sa, sb = runs / str(a_id) / "state", runs / str(b_id) / "state"
    if sa.is_dir() and sb.is_dir():
        try:
            equal, summary, details = compare_folders(sa, sb)
            ts = [json.loads((d / "trainer_state.json").read_text())
                  for d in (sa, sb) if (d / "trainer_state.json").is_file()]
            if len(ts) == 2 and ts[0] != ts[1]:
                equal = False
                summary += f"; trainer_state.json differs: {ts[0]} vs {ts[1]}"
        except (Failed, OSError, ValueError, KeyError) as e:
            equal, summary, details = False, f"cannot compare: {e}", {}
        ctx.save_json("resume-compare-state.json", details)
        ctx.check("resume: state", "PASS" if equal else "FAIL", f"state/ of A and B: {summary}")
    else:
        ctx.check("resume: state", "SKIP", f"no state/ folder in {sa} and {sb}")


def phase_download(ctx, server, api, a_id):
    listed = api.get_json(f"/api/jobs/{a_id}/checkpoints", name="checkpoints-A")
    names = [c.get("name") for c in listed]
    chosen = next((c for c in listed if c.get("name") == "final"), None)
    if chosen is None:
        ctx.check("download", "FAIL", f"job A has no final checkpoint: {names}")
        return
    files = {f["name"]: f["size"] for f in chosen.get("files") or []}
    target = ctx.s.work / f"job-{a_id}-final.tar"
    started = time.time()
    try:
        reply = api.call("GET", f"/api/jobs/{a_id}/checkpoints/final/archive", timeout=900,
                         stream_to=target, name="archive-A")
    except Failed as e:
        ctx.check("download", "FAIL", "no archive", str(e))
        return
    elapsed = time.time() - started
    if reply.status != 200:
        ctx.check("download", "FAIL", f"status {reply.status}", reply.text()[:2000])
        return
    size = target.stat().st_size
    problems = []
    members = {}
    try:
        with tarfile.open(target, "r:") as tar:
            for m in tar.getmembers():
                members[m.name] = m.size if m.isfile() else None
    except (tarfile.TarError, OSError) as e:
        problems.append(f"not a readable tar: {e}")
    files_in_tar = {Path(n).name: s for n, s in members.items() if s is not None}
    if members and not any(n.startswith("final/") or n == "final" for n in members):
        problems.append(f"entries are not under final/: {sorted(members)[:5]}")
    if "config.json" not in files_in_tar:
        problems.append("no config.json")
    if not any(n.endswith(".safetensors") for n in files_in_tar):
        problems.append("no .safetensors file")
    for name, listed_size in files.items():
        if files_in_tar.get(name) != listed_size:
            problems.append(f"{name}: {files_in_tar.get(name)} bytes in the tar, "
                            f"{listed_size} listed")
    ctype = reply.headers.get("Content-Type", "")
    ctx.figure("download_size", f"{size:,} bytes ({gb(size)}) in {elapsed:.1f} s")
    figures = (f"final of job {a_id}: {size:,} bytes ({gb(size)}) in {elapsed:.1f} s "
               f"({size / max(elapsed, 1e-6) / 1e9:.2f} GB/s), {ctype}, "
               f"{len(files_in_tar)} files: {', '.join(sorted(files_in_tar))}")
    ctx.check("download", "FAIL" if problems else "PASS", figures, "; ".join(problems))
    try:
        target.unlink()
    except OSError:
        pass


def sse_events(text):
    """(event, data) pairs of a server-sent events body; data parsed as JSON where it is."""
    events = []
    for frame in text.replace("\r\n", "\n").split("\n\n"):
        name, data = None, []
        for line in frame.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].removeprefix(" "))
        if name is None:
            continue
        try:
            events.append((name, json.loads("\n".join(data))))
        except ValueError:
            events.append((name, "\n".join(data)))
    return events


def try_turn(ctx, api, a_id, messages, label, stream):
    """One "try it" request; returns (reply JSON of `done`, start event or None, token events,
    seconds) or raises Failed."""
    s = ctx.s
    body = {"messages": messages, "max_new_tokens": s.max_new_tokens, "stream": stream}
    started = time.time()
    reply = api.call("POST", f"/api/jobs/{a_id}/checkpoints/final/generate", body,
                     timeout=s.timeout, name=f"generate-{label}")
    elapsed = time.time() - started
    if reply.status != 200:
        raise Failed(f"{label}: status {reply.status} after {elapsed:.1f} s: {reply.text()[:2000]}")
    if not stream:
        answer = reply.json_or_none()
        if not isinstance(answer, dict):
            raise Failed(f"{label}: not JSON: {reply.text()[:2000]}")
        return answer, None, 0, elapsed
    events = sse_events(reply.text())
    ctx.save_json(f"generate-{label}-events.json", events)
    names = [n for n, _ in events]
    if not names or names[0] != "start" or names[-1] != "done":
        raise Failed(f"{label}: events {names[:5]}...{names[-3:]}: {reply.text()[-2000:]}")
    tokens = [d.get("text", "") for n, d in events if n == "token" and isinstance(d, dict)]
    done = events[-1][1]
    if "".join(tokens) != done.get("text"):
        raise Failed(f"{label}: streamed text {''.join(tokens)!r} is not the answer "
                     f"{done.get('text')!r}")
    return done, events[0][1], len(tokens), elapsed


def phase_generate(ctx, server, api, a_id):
    """Try-it on job A's final checkpoint: on the free GPU, a conversation's first turn (JSON)
    and second turn (streamed, the model kept loaded); then with a job training on the GPU, the
    same turn runs on the CPU and says why."""
    s = ctx.s
    conversation = [{"role": "user", "content": s.prompt}]
    try:
        first, _, _, elapsed = try_turn(ctx, api, a_id, conversation, "turn1", stream=False)
        conversation += [{"role": "assistant", "content": first.get("text", "")},
                         {"role": "user", "content": "And twice that?"}]
        second, start, token_events, elapsed2 = try_turn(ctx, api, a_id, conversation, "turn2",
                                                         stream=True)
    except Failed as e:
        ctx.check("generate", "FAIL", "no answer", str(e))
        return
    want = gpu_members(s.gpu)[0] if gpu_members(s.gpu) else "cpu"
    ctx.figure("generation_device", first.get("device"))
    ctx.figure("generation_tokens_per_s_gpu", second.get("tokens_per_s"))
    figures = (f"turn 1 {elapsed:.1f} s on {first.get('device')} ({first.get('tokens')} tokens, "
               f"{first.get('tokens_per_s', 0):.1f} tok/s, chat={first.get('chat')}); turn 2 "
               f"streamed {token_events} token events, {second.get('tokens')} tokens, "
               f"{second.get('tokens_per_s', 0):.1f} tok/s, prompt {start.get('prompt_tokens')} "
               f"tokens, model reused={start.get('reused')}, {elapsed2:.1f} s; text "
               f"{json.dumps(second.get('text'))[:80]}")
    problems = []
    if first.get("device") != want or second.get("device") != want:
        problems.append(f"ran on {first.get('device')}/{second.get('device')}, not {want}")
    if start.get("reused") is not True:
        problems.append("the second turn loaded the model again")
    if not (second.get("text") or "").strip():
        problems.append("the second turn has no text")
    ctx.check("generate on the GPU, 2 turns", "FAIL" if problems else "PASS", figures,
              "; ".join(problems))
    if want == "cpu":
        return

    # A job training on the GPU: try-it must not take it; the CPU answers and says why.
    body = dict(resume_body(ctx, dataset_of(api, a_id)), steps=100000, save_every=None)
    body = {k: v for k, v in body.items() if v is not None}
    try:
        busy_id = api.submit(body, "busy")
        api.wait_job(busy_id, "busy", s.timeout,
                     until=lambda j: j.get("status") == "running" and (j.get("step") or 0) >= 1)
        cpu, start, _, elapsed = try_turn(ctx, api, a_id, conversation, "beside-training",
                                          stream=True)
    except Failed as e:
        ctx.check("generate beside training", "FAIL", "no answer", str(e))
        return
    finally:
        try:
            api.call("POST", f"/api/jobs/{busy_id}/cancel", {}, name="cancel-busy")
            api.wait_job(busy_id, "busy", s.timeout)
        except (Failed, NameError, UnboundLocalError):
            pass
    note = cpu.get("device_note") or ""
    figures = (f"{cpu.get('device')}, {cpu.get('tokens')} tokens, {cpu.get('tokens_per_s', 0):.1f} "
               f"tok/s, {elapsed:.1f} s; note {note!r}; same text as the GPU: "
               f"{cpu.get('text') == second.get('text')}")
    ok = cpu.get("device") == "cpu" and "training job" in note
    ctx.check("generate beside training", "PASS" if ok else "FAIL", figures,
              "" if ok else "expected the CPU with a note naming the training job")


def dataset_of(api, job_id):
    job = api.job(job_id)
    return job.get("dataset_id") or job.get("dataset")


# ----------------------------------------------------------------------------------------------


def parse_parts(value):
    parts = [p.strip() for p in value.split(",") if p.strip()]
    bad = [p for p in parts if p not in PARTS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown part(s) {bad}; parts: {', '.join(PARTS)}")
    return parts


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("binary", nargs="?", default=".gpu/sluice", help="the sluice binary")
    ap.add_argument("out", nargs="?", default=os.environ.get("OUT") or "./e2e-out",
                    help="output folder [default: $OUT or ./e2e-out]")
    ap.add_argument("--only", type=parse_parts, help=f"comma-separated parts: {','.join(PARTS)}")
    ap.add_argument("--skip", type=parse_parts, default=[], help="parts to leave out")
    ap.add_argument("--skip-bench", action="store_true",
                    help="same as --skip bench (the ratio then uses E2E_BENCH_JSON or "
                         "OUT/bench7b.json when present)")
    args = ap.parse_args()

    parts = args.only or list(PARTS)
    skip = set(args.skip) | ({"bench"} if args.skip_bench else set())
    parts = [p for p in parts if p not in skip]
    if not parts:
        sys.exit("nothing to run")

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    binary = Path(args.binary).resolve()
    settings = Settings()
    ctx = Ctx(out, settings, binary)
    if not (binary.is_file() and os.access(binary, os.X_OK)):
        ctx.check("setup", "FAIL", f"{binary} is not an executable file")
        print(ctx.table())
        return 2

    def on_term(signum, _frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, on_term)

    settings.work.mkdir(parents=True, exist_ok=True)
    marker = settings.work / ".sluice-e2e"
    data_dir = settings.work / "data"
    if data_dir.exists() and not marker.exists():
        ctx.check("setup", "FAIL", f"{data_dir} exists but {settings.work} was not made by this "
                  "script (no .sluice-e2e marker); choose another E2E_WORK")
        print(ctx.table())
        return 1
    marker.write_text("work folder of scripts/gpu/appliance_e2e.py\n")
    for pidfile in ("server.pid", "bench.pid"):
        stop_leftover(settings.work / pidfile, ctx)
    if data_dir.exists():
        ctx.say(f"removing the data folder of an earlier run: {data_dir}")
        shutil.rmtree(data_dir)
    data_dir.mkdir(parents=True)

    ctx.say(f"sluice e2e: binary {binary}, output {out}, data {data_dir}, parts {parts}")
    ctx.say("settings: " + json.dumps(settings.as_dict()))
    ctx.save_json("settings.json", {"settings": settings.as_dict(), "parts": parts,
                                    "binary": str(binary)})
    try:
        version = subprocess.run([str(binary), "--version"], capture_output=True, text=True,
                                 timeout=30)
        ctx.figure("version", (version.stdout or version.stderr).strip())
    except (OSError, subprocess.TimeoutExpired) as e:
        ctx.warn(f"{binary} --version: {e}")
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=index,name,memory.used,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=30)
        ctx.say("nvidia-smi: " + (smi.stdout.strip() or smi.stderr.strip()))
    except (OSError, subprocess.TimeoutExpired):
        ctx.say("nvidia-smi: not available")
    disk = shutil.disk_usage(data_dir)
    mem = meminfo()
    ctx.say(f"disk at {data_dir}: {gb(disk.free)} free of {gb(disk.total)}; host memory "
            f"{gb(mem.get('MemTotal', 0))}, available {gb(mem.get('MemAvailable', 0))}")

    server = None
    try:
        bench_tps = None
        if "bench" in parts:
            bench_tps = phase_bench(ctx)
        else:
            # An earlier bench: named, in OUT, or kept in E2E_WORK by a run on this machine.
            name = bench_json_name(settings.preset)
            candidates = [Path(settings.bench_json)] if settings.bench_json else []
            candidates += [out / name, settings.work / name]
            found = next((p for p in candidates if p.is_file()), None)
            if settings.bench_json and not Path(settings.bench_json).is_file():
                ctx.warn(f"E2E_BENCH_JSON={settings.bench_json} is not a file")
            if found is not None and "api" in parts:
                bench_tps = read_bench(ctx, found, skipped=True)
            elif "api" in parts:
                ctx.warn(f"no bench baseline ({', '.join(map(str, candidates))}): the API "
                         "throughput is measured but not compared")

        api_parts = [p for p in parts if p != "bench"]
        if api_parts:
            server = Server(ctx, data_dir)
            try:
                health = server.start()
                api = Api(ctx, server)
                user = api.login()
                gpus = api.get_json("/api/gpus", name="gpus")
                ids = [g.get("id") for g in gpus]
                ctx.check("server and login", "PASS",
                          f"{health.strip()[:80]}; logged in as {user.get('username')} "
                          f"({user.get('role')}); devices {ids}")
            except (Failed, ServerDied) as e:
                ctx.check("server and login", "FAIL", "the appliance did not start or log in",
                          str(e))
                raise
            missing = [w for w in gpu_members(settings.gpu) if w not in ids]
            if missing:
                ctx.warn(f"the appliance lists {ids}, not {missing}: jobs on {settings.gpu} "
                         "will be refused (NVML not found? LD_LIBRARY_PATH)")
            dataset = phase_dataset(ctx, api)

            if "api" in parts:
                try:
                    phase_api(ctx, server, api, dataset, bench_tps)
                except (Failed, ServerDied) as e:
                    ctx.check("api throughput", "FAIL", "the part stopped", str(e))
                    server.ensure()
                    api.login()

            a = None
            if any(p in parts for p in ("resume", "download", "generate")):
                server.ensure()
                try:
                    a = run_job_a(ctx, server, api, dataset)
                except (Failed, ServerDied) as e:
                    ctx.check("job A completes", "FAIL", "the part stopped", str(e))
                    server.ensure()
                    api.login()
            if a is not None:
                a_id, a_points = a
                for part, fn in (("resume", lambda: phase_resume(ctx, server, api, dataset,
                                                                 a_id, a_points)),
                                 ("download", lambda: phase_download(ctx, server, api, a_id)),
                                 ("generate", lambda: phase_generate(ctx, server, api, a_id))):
                    if part not in parts:
                        continue
                    try:
                        server.ensure()
                        api.login()
                        fn()
                    except (Failed, ServerDied) as e:
                        ctx.check(part, "FAIL", "the part stopped", str(e))
            elif any(p in parts for p in ("resume", "download", "generate")):
                for part in ("resume", "download", "generate"):
                    if part in parts:
                        ctx.check(part, "SKIP", "job A did not complete")
    except (Failed, ServerDied):
        pass
    except KeyboardInterrupt:
        ctx.check("run", "FAIL", "interrupted (Ctrl-C)")
    except SystemExit as e:
        ctx.check("run", "FAIL", f"stopped by a signal (exit {e.code})")
    except Exception as e:  # a bug in this script: say where, still write the summary
        ctx.check("run", "FAIL", f"unexpected {type(e).__name__}: {e}", traceback.format_exc())
        ctx.say(traceback.format_exc())
    finally:
        if server is not None:
            try:
                server.stop()
            except Exception as e:  # noqa: BLE001 (teardown must go on)
                ctx.warn(f"stopping the server: {e}")
        kill_children()
        if settings.clean:
            shutil.rmtree(data_dir, ignore_errors=True)

    table = ctx.table()
    ctx.write_results()
    print("\n" + table, flush=True)
    ctx.log_file.write("\n" + table + "\n")
    ctx.say(f"summary: {out / 'summary.txt'}; results: {out / 'results.json'}")
    return 1 if ctx.failed() else 0


if __name__ == "__main__":
    sys.exit(main())
