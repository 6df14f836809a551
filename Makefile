# The two commands of the README: `make demo` and `make test`. Both bootstrap uv and the
# environment on first use, then run without re-syncing.
UV := $(shell command -v uv 2>/dev/null || echo python3 -m uv)
RUN := $(UV) run --no-sync
export RAY_ENABLE_UV_RUN_RUNTIME_ENV := 0

.PHONY: sync sync-gpu demo test test-fast lint build
sync:
	@scripts/bootstrap.sh cpu
sync-gpu:
	@scripts/bootstrap.sh gpu

demo: sync
	$(RUN) grpo train

test: sync
	$(RUN) pytest packages tests -n 2 --dist loadfile --no-loadscope-reorder --durations=25

test-fast: sync
	$(RUN) pytest packages tests -m "not slow"

# ruff (lint, import order, complexity, format) and basedpyright (basic; errors older than the checker are in
# .basedpyright/baseline.json). `make test` runs the same checks (tests/test_lint.py).
lint:
	$(RUN) ruff check .
	$(RUN) ruff format --check .
	$(RUN) basedpyright

build:
	$(UV) build --all-packages -o dist
