#!/usr/bin/env bash
# Bring a fresh machine to a working grpo environment: uv, the link to the local CPU torch
# wheels, and `uv sync` from the committed lock. Idempotent; re-syncs only when the lock or a
# pyproject changed. Usage: scripts/bootstrap.sh [cpu|gpu]
set -euo pipefail
cd "$(dirname "$0")/.."
stack="${1:-cpu}"
UV_VERSION="0.13.9"

if command -v uv >/dev/null 2>&1; then
  uv=(uv)
else
  if ! python3 -m uv --version >/dev/null 2>&1; then
    echo "bootstrap: installing uv ${UV_VERSION} with pip" >&2
    python3 -m pip install --quiet --disable-pip-version-check "uv==${UV_VERSION}"
  fi
  uv=(python3 -m uv)
fi

# Registries behind a TLS proxy: uv trusts only its built-in roots unless told otherwise, so
# reuse the CA bundle pip is configured with when SSL_CERT_FILE is not already set.
if [ -z "${SSL_CERT_FILE:-}" ]; then
  cert="$(python3 -m pip config list 2>/dev/null | sed -n "s/^.*\.cert='\([^' ]*\)'.*$/\1/p" | head -n1)"
  cert="${PIP_CERT:-$cert}"
  if [ -n "$cert" ] && [ -f "$cert" ]; then
    export SSL_CERT_FILE="$cert"
  fi
fi

# The CPU torch build lives in pip's find-links folder on machines of this kind; the lock
# names it through the relative index ./wheels, so link it here instead of hard-coding it.
if [ "$stack" = cpu ] && [ ! -e wheels ]; then
  links="$(python3 -m pip config list 2>/dev/null | sed -n "s/^.*find-links='\([^' ]*\)'.*$/\1/p" | head -n1)"
  links="${PIP_FIND_LINKS:-$links}"
  if [ -z "$links" ] || ! ls "$links"/torch-2.13.0+cpu-*.whl >/dev/null 2>&1; then
    echo "bootstrap: no torch-2.13.0+cpu wheel found in pip's find-links folder ('${links}')." >&2
    echo "bootstrap: put the CPU wheel in a folder and link it as ./wheels, or use 'scripts/bootstrap.sh gpu' on a GPU machine." >&2
    exit 1
  fi
  ln -s "$links" wheels
fi

stamp=".venv/.grpo-synced-${stack}"
inputs=(uv.lock pyproject.toml packages/*/pyproject.toml)
if [ -f "$stamp" ] && [ -z "$(find "${inputs[@]}" -newer "$stamp" 2>/dev/null)" ]; then
  exit 0
fi
if [ "$stack" = gpu ]; then
  "${uv[@]}" sync --frozen --no-group cpu --group gpu
else
  "${uv[@]}" sync --frozen
fi
touch "$stamp"
