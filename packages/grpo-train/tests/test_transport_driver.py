"""The IPC transport decides from the policy rank's device, not the driver's (a CPU-only head
node drives GPU workers). No Ray: the rank's answer is a plain value."""

from __future__ import annotations

import pytest

from grpo_train.refit.ipc import IpcTransport


class _Rank:
    """A policy group whose rank 0 runs on `backend` (a plain driver object: the answer is a value)."""

    def __init__(self, backend: str) -> None:
        self.backend = backend

    def collective_backend(self) -> str:
        return self.backend


def test_ipc_connect_asks_the_policy_rank(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)  # the driver has no GPU
    IpcTransport(1 << 20).connect(_Rank("nccl"), [])  # the rank is on a GPU: accepted
    with pytest.raises(RuntimeError, match="'ipc' needs GPUs"):
        IpcTransport(1 << 20).connect(_Rank("gloo"), [])
