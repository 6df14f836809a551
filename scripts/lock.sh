#!/usr/bin/env bash
# Re-lock the workspace and check that the lock names no machine's path (uv writes an index
# named in [tool.uv.sources] as an absolute file:// URL: astral-sh/uv#15055, so the local
# wheel folder is never named there).
set -euo pipefail
cd "$(dirname "$0")/.."
uv="$(command -v uv || echo 'python3 -m uv')"
$uv lock "$@"
if grep -n "file://" uv.lock; then
  echo "lock.sh: uv.lock names a local path (above); it must stay machine-independent" >&2
  exit 1
fi
