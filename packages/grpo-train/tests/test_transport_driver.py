"""The IPC transport decides from the policy rank's device, not the driver's (a CPU-only head
node drives GPU workers). No Ray: the rank's answer is a plain value."""

from __future__ import annotations

import pytest

from grpo_train.refit.ipc import IpcTransport


class _Rank:
    def __init__(self, backend: str) -> None:
        self.collective_backend = type("M", (), {"remote": staticmethod(lambda: backend)})()


def test_ipc_connect_asks_the_policy_rank(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "get", lambda value: value)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)  # the driver has no GPU
    IpcTransport(1 << 20).connect(_Rank("nccl"), [])  # the rank is on a GPU: accepted
    with pytest.raises(RuntimeError, match="'ipc' needs GPUs"):
        IpcTransport(1 << 20).connect(_Rank("gloo"), [])
