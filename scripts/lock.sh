#!/usr/bin/env bash
# Re-lock the workspace. uv stores the relative flat index `./wheels` as an absolute file://
# URL in the lock's requires-dist metadata (astral-sh/uv#15055); rewrite it back so the lock
# names no machine's path. Syncs use --frozen, which never compares that field.
set -euo pipefail
cd "$(dirname "$0")/.."
uv="$(command -v uv || echo 'python3 -m uv')"
$uv lock "$@"
root_url="file://$(pwd -P)/wheels"
sed -i "s#index = \"${root_url}\"#index = \"./wheels\"#g" uv.lock
if grep -n "file://" uv.lock; then
  echo "lock.sh: uv.lock still names a local path (above)" >&2
  exit 1
fi
