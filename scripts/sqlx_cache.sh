#!/usr/bin/env bash
# The offline cache of the server's compile-checked queries (server/.sqlx/), which lets every
# build check each `sqlx::query!` against the schema without a database.
#
#   scripts/sqlx_cache.sh prepare   rewrite the cache (after changing a query or a migration)
#   scripts/sqlx_cache.sh check     fail if the committed cache differs from what the queries
#                                   and migrations give now (scripts/test.sh runs this)
#
# Both build a fresh database from migrations/ and type-check the server against it, with the
# macros writing what they learn into a scratch folder that is then compared or copied.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
mode=${1:-check}
case "$mode" in prepare | check) ;; *) echo "usage: $0 prepare|check" >&2; exit 2 ;; esac
command -v sqlite3 >/dev/null 2>&1 || { echo "error: sqlite3 is needed (apt-get install sqlite3)" >&2; exit 1; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for migration in $(ls migrations/*.sql | sort); do
  sqlite3 -bail "$work/schema.db" < "$migration"
done
mkdir "$work/cache"
# Cargo does not track the macros' environment, so an unchanged crate would not expand them
# again: touching the crate root makes it.
touch server/src/lib.rs server/src/main.rs
DATABASE_URL="sqlite://$work/schema.db" SQLX_OFFLINE=false SQLX_OFFLINE_DIR="$work/cache" \
  cargo check --quiet -p sluice --all-targets
touch server/src/lib.rs server/src/main.rs

if [ "$mode" = prepare ]; then
  rm -rf server/.sqlx
  cp -r "$work/cache" server/.sqlx
  echo "server/.sqlx: $(ls server/.sqlx | wc -l) queries"
  exit 0
fi
if ! diff -r -q server/.sqlx "$work/cache" >"$work/diff"; then
  cat "$work/diff" >&2
  echo "error: server/.sqlx is stale: run scripts/sqlx_cache.sh prepare and commit the result" >&2
  exit 1
fi
echo "server/.sqlx matches the queries and migrations ($(ls server/.sqlx | wc -l) queries)"
