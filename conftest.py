"""Test-session environment shared by every package's tests.

Variables that must be set before the libraries read them (Triton reads TRITON_INTERPRET at
import; Ray and vLLM read theirs at start) are set here, at collection time.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402

# `make test` hands whole files to 2 xdist workers (--dist loadfile) in collection order
# (--no-loadscope-reorder: xdist's default puts files with the most tests first, which left the
# few-test end-to-end files, 3-12 minutes each, for the end of the run, where one worker ran on
# alone). These files go first, longest first (their time in the clean-clone CI run of 6f6dfb3),
# so the many short files fill in behind them on both workers. An unlisted file keeps its place.
# The last three (in the clean-clone run of 498dba0: custom_env's `grpo train` run alone 67 s, lint's
# basedpyright 34 s; the kernels wheel install 33 s) were the tail of the collection order, where one
# worker could run them while the other had nothing left.
LONGEST_FIRST = (
    "tests/test_e2e_grpo.py",
    "tests/test_e2e_async.py",
    "tests/test_e2e_ppo.py",
    "tests/test_placement.py",
    "packages/grpo-train/tests/test_generation_group.py",
    "packages/grpo-train/tests/test_engine_faults.py",
    "packages/grpo-train/tests/test_fsdp.py",
    "tests/test_e2e_recipes.py",
    "packages/grpo-train/tests/test_multi_turn.py",
    "packages/grpo-train/tests/test_async_loop.py",
    "tests/test_multinode.py",
    "packages/grpo-train/tests/test_weight_transport.py",
    "packages/grpo-train/tests/test_refit.py",
    "tests/test_custom_env.py",
    "tests/test_kernels_install.py",
    "tests/test_lint.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable: the rest keep order


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for the whole test session (ray.init costs 11-16 s on 2 cores). Started as
    `grpo train` starts it (grpo_train.setup.start_local_head): taking turns with the other
    worker's runs and heads, and started once more if Ray's agents miss the raylet's deadline."""
    import ray

    if not ray.is_initialized():
        from grpo_train.setup import start_local_head

        start_local_head(
            lambda: ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False),
            ray.shutdown,
        )
    yield ray
