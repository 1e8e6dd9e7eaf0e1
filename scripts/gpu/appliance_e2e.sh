#!/usr/bin/env bash
# End-to-end check of the Sluice appliance on the GPU machine, through its JSON API as the
# browser drives it:
#   1. bench:    `sluice bench train` baseline (median tokens/s of steps 3..N)
#   2. api:      the same shape as a job through the API (plan, submit, wait, metrics);
#                ratio API / bench >= E2E_MIN_RATIO
#   3. resume:   two identical small jobs, B killed with the server (kill -9) after a
#                checkpoint, restarted, resumed; final tensors equal to A's bit for bit
#   4. download: the archive of job A's final checkpoint is a tar with config.json + safetensors
#   5. generate: "try it" on job A's final checkpoint answers with text
# then prints a table (also OUT/summary.txt; OUT/results.json has every figure).
#
# Usage:
#   scripts/gpu/appliance_e2e.sh [SLUICE_BIN] [OUT_DIR] [--only PARTS] [--skip PARTS] [--skip-bench]
#     SLUICE_BIN  prebuilt release binary [default: .gpu/sluice]
#     OUT_DIR     logs, replies, metrics, summary [default: $OUT, else ./e2e-out]
#     PARTS       comma-separated: bench,api,resume,download,generate
#                 (download and generate need job A, which `resume` also runs)
# Examples:
#   scripts/gpu/appliance_e2e.sh .gpu/sluice "$OUT"                          # everything
#   scripts/gpu/appliance_e2e.sh .gpu/sluice "$OUT" --only bench,api          # the 7B parts
#   scripts/gpu/appliance_e2e.sh .gpu/sluice "$OUT" --only resume,download,generate
#   E2E_BENCH_JSON=prev/bench7b.json scripts/gpu/appliance_e2e.sh .gpu/sluice "$OUT" --only api
#   E2E_PRESET=qwen2.5-0.5b E2E_SEQ_LEN=512 scripts/gpu/appliance_e2e.sh   # a quick run
# Where one command may run at most 10 minutes, split it: the 7B bench and the 7B job take a
# few minutes each (weights init, pinning ~100 GB, 6 + 8 steps of ~10 s). A bench JSON is also
# kept in E2E_WORK, so `--only api` on the same (still warm) machine finds its baseline.
# The 7B job's final save writes ~107 GB (f32 state + checkpoint): where the disk cannot hold
# it, E2E_API_END=auto measures the 8 steps, then kills the server instead of waiting (SKIP).
#
# Exit status: 0 when every check passed (or was skipped), 1 when one failed, 2 bad usage.
# Needs python3 (standard library only). The appliance's data folder (checkpoints: several GB)
# goes under E2E_WORK, not OUT_DIR; it is wiped at the start of each run.
set -euo pipefail

# ---- what is measured (environment overrides) -------------------------------------------------
# Throughput: bench and the API job use the same model and shape.
: "${E2E_PRESET:=qwen2.5-7b}"         # random-init preset (engine/src/spec/preset.rs)
: "${E2E_SEQ_LEN:=1024}"
: "${E2E_MICRO_BATCH:=8}"
: "${E2E_GRAD_ACCUM:=8}"
: "${E2E_BENCH_STEPS:=6}"             # bench steps; its median is over steps 3..N
: "${E2E_STEPS:=8}"                   # API job steps; the median is over steps 3..N
: "${E2E_GPU:=cuda:0}"                # the job's "gpu" (cpu | cuda:0 | cuda:0,1); bench uses the first
: "${E2E_MIN_RATIO:=0.95}"            # API tokens/s over bench tokens/s needed to pass
: "${E2E_BENCH_JSON:=}"               # with --skip-bench: an earlier bench JSON for the ratio
: "${E2E_API_END:=auto}"              # auto | wait | kill: after the last step of the API job,
                                      # wait for completion, or kill the server (auto: kill
                                      # only when the disk cannot hold the final save)
# Exact resume (a small model, so it is quick).
: "${E2E_RESUME_PRESET:=qwen2.5-0.5b}"
: "${E2E_RESUME_SEQ_LEN:=256}"
: "${E2E_RESUME_MICRO_BATCH:=4}"
: "${E2E_RESUME_GRAD_ACCUM:=2}"
: "${E2E_RESUME_STEPS:=12}"
: "${E2E_RESUME_SAVE_EVERY:=3}"
: "${E2E_RESUME_SAVE_DTYPE:=f32}"
: "${E2E_KILL_AFTER_CHECKPOINT:=3}"   # kill once a checkpoint at this step or later exists ...
: "${E2E_KILL_AT_STEP:=5}"            # ... and the job has stored this step
# Generation.
: "${E2E_PROMPT:=How much is 107 plus 138?}"
: "${E2E_MAX_NEW_TOKENS:=24}"
# Timeouts, seconds.
: "${E2E_BENCH_TIMEOUT:=1200}"        # the bench process
: "${E2E_API_TIMEOUT:=1200}"          # the API throughput job, from submission
: "${E2E_API_SAVE_TIMEOUT:=600}"      # the API job's final save, after its last step is stored
: "${E2E_TIMEOUT:=600}"               # every other job wait, download and generation
: "${E2E_START_TIMEOUT:=180}"         # the server answering /healthz
# Where the appliance keeps its data; E2E_CLEAN=1 removes it at the end.
: "${E2E_WORK:=/tmp/sluice-e2e}"
: "${E2E_CLEAN:=0}"
: "${E2E_DATASET:=}"                  # file to upload [default: datasets/demo-alpaca.jsonl]
export E2E_PRESET E2E_SEQ_LEN E2E_MICRO_BATCH E2E_GRAD_ACCUM E2E_BENCH_STEPS E2E_STEPS E2E_GPU \
    E2E_MIN_RATIO E2E_BENCH_JSON E2E_API_END E2E_RESUME_PRESET E2E_RESUME_SEQ_LEN \
    E2E_RESUME_MICRO_BATCH E2E_RESUME_GRAD_ACCUM E2E_RESUME_STEPS E2E_RESUME_SAVE_EVERY \
    E2E_RESUME_SAVE_DTYPE E2E_KILL_AFTER_CHECKPOINT E2E_KILL_AT_STEP E2E_PROMPT \
    E2E_MAX_NEW_TOKENS E2E_BENCH_TIMEOUT E2E_API_TIMEOUT E2E_API_SAVE_TIMEOUT E2E_TIMEOUT \
    E2E_START_TIMEOUT E2E_WORK E2E_CLEAN E2E_DATASET

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

case "${1:-}" in
    -h|--help)
        sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'
        exit 0
        ;;
esac

command -v python3 >/dev/null || { echo "FAIL setup: python3 is not on PATH" >&2; exit 2; }

# NVML and the driver live in /usr/local/nvidia/lib64 on the GPU machine; the appliance loads
# them at run time and lists only the CPU when it cannot find them.
for dir in /usr/local/nvidia/lib64 /usr/local/cuda/lib64; do
    if [[ -d "$dir" && ":${LD_LIBRARY_PATH:-}:" != *":$dir:"* ]]; then
        export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$dir"
    fi
done

exec python3 -u "$here/appliance_e2e.py" "$@"
