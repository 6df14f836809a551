"""The refit package's registry (grpo_train/refit/__init__.py): every transport is one module holding
its driver-side class, a trainer-side `send_<name>` and an engine-side `receive_<name>`, the vLLM
worker extension receives as `grpo_receive_<name>`, and the README's transport table names exactly
the registered transports. No Ray, no vLLM engine: the modules are inspected."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from grpo_train.generation.vllm_worker_ext import GrpoWorkerExtension
from grpo_train.refit import TRANSPORTS, choose_transport, make_transport

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.parametrize("name", sorted(TRANSPORTS))
def test_each_transport_is_one_module_with_paired_ends(name):
    module = importlib.import_module(f"grpo_train.refit.{name}")
    cls = TRANSPORTS[name]
    assert cls.__module__ == module.__name__ and cls.name == name
    assert callable(getattr(module, f"send_{name}")) and callable(getattr(module, f"receive_{name}"))
    assert callable(getattr(GrpoWorkerExtension, f"grpo_receive_{name}"))
    assert callable(cls.connect) and callable(cls.push)


def test_readme_table_names_the_registered_transports():
    text = README.read_text()
    table = text[text.index("## Refit transports") : text.index("## LoRA")]
    rows = re.findall(r"^\| `(\w+)` \| `refit/(\w+)\.py` \|", table, flags=re.M)
    assert sorted(rows) == sorted((name, name) for name in TRANSPORTS)


def test_auto_and_unknown_transports():
    assert choose_transport("auto", colocated=True, on_gpus=True) == "ipc"
    assert choose_transport("auto", colocated=True, on_gpus=False) == "object_store"
    assert choose_transport("auto", colocated=False, on_gpus=True) == "collective"
    assert choose_transport("collective", colocated=True, on_gpus=False) == "collective"
    # LoRA: adapters (a few MiB) always through the object store; merged weights as without LoRA
    assert choose_transport("auto", colocated=False, on_gpus=True, lora_refit="adapter") == "object_store"
    assert choose_transport("object_store", colocated=True, on_gpus=True, lora_refit="adapter") == "object_store"
    assert choose_transport("auto", colocated=False, on_gpus=True, lora_refit="merged") == "collective"
    assert make_transport("collective", 0.5).bucket_bytes == 1 << 29
    with pytest.raises(ValueError, match="policy.generation.weight_transport: unknown transport 'nccl'"):
        make_transport("nccl", 1.0)
