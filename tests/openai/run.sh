#!/usr/bin/env bash
# The OpenAI-compatible endpoint (/v1) checked by OpenAI's own Python client and by
# lm-evaluation-harness, against the release binary serving the real SmolLM2-135M-Instruct
# (the GGUF test asset, imported into a fresh data directory). No GPU and no Hugging Face Hub:
# the model runs on the CPU and lm-eval's task is local (tests/openai/tasks).
#
#   bash tests/openai/run.sh        (after cargo build --release and scripts/fetch_test_assets.sh)
#
# Installs the pinned packages of tests/openai/requirements.txt into .cache/openai-venv once
# (about 1 GB, a few minutes; no torch), reused while that file is unchanged. lm-eval's results
# are kept in .cache/openai-results/lm_eval.json. Exits non-zero if any check fails.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
started=$SECONDS
step() {
  printf '  [%4ds] %s\n' "$((SECONDS - started))" "$*"
}

binary=${SLUICE_BIN:-$root/target/release/sluice}
gguf=$root/.cache/test-assets/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
[ -x "$binary" ] || { echo "error: $binary does not exist: run cargo build --release" >&2; exit 1; }
[ -f "$gguf" ] || { echo "error: $gguf is missing: run scripts/fetch_test_assets.sh" >&2; exit 1; }
if ! python3 -c 'import ensurepip, venv' >/dev/null 2>&1; then
  echo "error: python3 cannot make virtual environments (Debian: apt-get install python3-venv)" >&2
  exit 1
fi

# --- the Python packages, pinned -------------------------------------------------------------
venv=$root/.cache/openai-venv
requirements=tests/openai/requirements.txt
want=$(sha256sum "$requirements" | cut -d' ' -f1)
stamp=$venv/.requirements.sha256
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  step "reusing $venv"
else
  step "installing $requirements into $venv"
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check --no-cache-dir -r "$requirements"
  echo "$want" >"$stamp"
  step "installed ($(du -sh "$venv" | cut -f1))"
fi
python=$venv/bin/python

# --- a fresh appliance with the model --------------------------------------------------------
data=$(mktemp -d "${TMPDIR:-/tmp}/sluice-openai-XXXXXX")
server_pid=
cleanup() {
  if [ -n "$server_pid" ] && kill -0 "$server_pid" 2>/dev/null; then
    kill "$server_pid"
    wait "$server_pid" 2>/dev/null || true
  fi
  rm -rf "$data"
}
trap cleanup EXIT
show_log() {
  echo "--- the server's log (last 60 lines) ---" >&2
  tail -n 60 "$data/server.log" >&2 || true
}

# A folder under the appliance's models/ is the model `local:<folder>`, as an import leaves it.
appliance=$data/appliance
model_dir=$appliance/models/smollm2
model=local:smollm2
step "importing SmolLM2-135M-Instruct"
"$binary" import-gguf "$gguf" --out "$model_dir" >/dev/null

port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
url=http://127.0.0.1:$port
SLUICE_ADDR=127.0.0.1:$port SLUICE_DATA_DIR=$appliance RUST_LOG=${RUST_LOG:-warn} \
  "$binary" serve >"$data/server.log" 2>&1 &
server_pid=$!
if ! python3 - "$url" <<'EOF'; then
import sys, time, urllib.request
deadline = time.time() + 30
while time.time() < deadline:
    try:
        with urllib.request.urlopen(sys.argv[1] + "/healthz", timeout=2) as reply:
            if reply.status == 200:
                sys.exit(0)
    except OSError:
        time.sleep(0.2)
sys.exit(1)
EOF
  echo "error: the server did not answer on $url within 30 s" >&2
  show_log
  exit 1
fi
step "server up on $url"
token=$(python3 tests/openai/admin_token.py "$url")

# --- OpenAI's client -------------------------------------------------------------------------
step "openai client checks"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HOME=$data/hf
export TRANSFORMERS_VERBOSITY=error
if ! SLUICE_OPENAI_BASE=$url/v1 SLUICE_API_KEY=$token SLUICE_MODEL=$model \
  SLUICE_TOKENIZER_DIR=$model_dir timeout 600 "$python" tests/openai/test_client.py; then
  show_log
  exit 1
fi

# --- lm-evaluation-harness -------------------------------------------------------------------
# local-completions sends token ids (tokenized_requests) counted with the model folder's own
# tokenizer, and scores each choice from the echoed log-probabilities.
step "lm_eval --model local-completions --tasks sluice_facts"
model_args="model=$model,base_url=$url/v1/completions,tokenizer_backend=huggingface"
model_args+=",tokenizer=$model_dir,tokenized_requests=True,max_length=2048"
if ! OPENAI_API_KEY=$token timeout 1200 "$python" -m lm_eval --model local-completions \
  --model_args "$model_args" --tasks sluice_facts --include_path tests/openai/tasks \
  --output_path "$data/lm_eval" >"$data/lm_eval.log" 2>&1; then
  tail -n 40 "$data/lm_eval.log" >&2
  show_log
  exit 1
fi
results=$(find "$data/lm_eval" -name 'results_*.json' | sort | tail -n 1)
[ -n "$results" ] || { echo "error: lm_eval wrote no results" >&2; tail -n 40 "$data/lm_eval.log" >&2; exit 1; }
mkdir -p .cache/openai-results
cp "$results" .cache/openai-results/lm_eval.json
"$python" tests/openai/check_lm_eval.py .cache/openai-results/lm_eval.json sluice_facts

# The same task scored by Sluice's own task evaluation: the questions as the task's doc_to_text
# writes them ("Question: ...\nAnswer:"), each choice after a space, as lm_eval scores them.
step "sluice eval --metric choice on the same task"
"$python" - tests/openai/tasks/capitals_and_facts.jsonl "$data/sluice_facts.jsonl" <<'EOF'
import json, sys
with open(sys.argv[1]) as src, open(sys.argv[2], "w") as out:
    for line in src:
        record = json.loads(line)
        record["question"] = f"Question: {record['question']}\nAnswer:"
        out.write(json.dumps(record) + "\n")
EOF
"$binary" eval --model "$model_dir" --data "$data/sluice_facts.jsonl" --metric choice \
  --report .cache/openai-results/sluice_eval.json
"$python" tests/openai/same_as_sluice_eval.py .cache/openai-results/lm_eval.json sluice_facts \
  .cache/openai-results/sluice_eval.json
step "all passed (results in .cache/openai-results/lm_eval.json)"
