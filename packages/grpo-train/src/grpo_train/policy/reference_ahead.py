"""The reference forward beside training: reference logprobs computed in a second thread of the
policy worker while the training micro-batches run, each ready before its micro-batch's loss.

Job: `ReferenceAhead` runs the frozen reference model over the step's micro-batches, in order, in a
background thread, writing each one's logprobs into a [B, S] tensor and signalling it; the training
loop waits for micro-batch i's rows (`wait(i)`) after its own forward and before its loss. On a
2-core machine a training forward and backward leave the second core partly idle (Python dispatch,
autograd bookkeeping, single-threaded ops); the reference forward fills it.

Bitwise: the thread computes exactly what `PolicyWorker.logprobs(batch, reference=True)` computes
(the same micro-batch plan, the same function per micro-batch, the same float32 placement into a
zeroed [B, S] tensor); only the time it runs changes. The reference weights are frozen and never
touched by the training thread. `usable` says where this holds: one rank (no collective inside a
forward), a reference model of its own (LoRA's reference is the policy with its adapters disabled,
which the training thread is using), and logprob micro-batches equal to the training ones (so
micro-batch i's rows are ready when training micro-batch i needs them).
Boundary: no knowledge of the loss or the optimizer; the worker passes its per-micro-batch forward.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch


def usable(world_size: int, has_own_reference: bool, logprob_plan: Sequence, train_plan: Sequence) -> bool:
    """Whether the reference forward may run beside training (see the module docstring)."""
    return world_size == 1 and has_own_reference and list(logprob_plan) == list(train_plan)


class ReferenceAhead:
    """Reference logprobs of `plan`'s micro-batches into `out` ([B, S], zeros where no row writes),
    in a background thread started at construction; `forward(mb)` gives one micro-batch's [rows, W]
    logprobs. `close()` joins the thread (call it in a `finally`)."""

    def __init__(self, plan: Sequence, forward: Callable, out: torch.Tensor) -> None:
        self.out = out  # [B, S]
        self._plan = list(plan)
        self._forward = forward
        self._ready = [threading.Event() for _ in self._plan]
        self._error: BaseException | None = None
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="grpo-reference-ahead", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            with torch.no_grad():  # grad mode is per thread
                for i, mb in enumerate(self._plan):
                    if self._stop:
                        return
                    lp = self._forward(mb)  # [rows, W]
                    self.out[torch.tensor(mb.rows), : lp.shape[1]] = lp.float().cpu()
                    self._ready[i].set()
        except BaseException as exc:  # noqa: BLE001 - handed to the training thread by wait()
            self._error = exc
        finally:
            for event in self._ready:
                event.set()

    def wait(self, i: int) -> None:
        """Block until micro-batch i's reference logprobs are in `out`; re-raise the thread's error."""
        self._ready[i].wait()
        if self._error is not None:
            raise self._error

    def wait_for(self, mb) -> None:
        """`wait` for the micro-batch `mb` of the plan (the training plan equals this one: `usable`)."""
        self.wait(self._plan.index(mb))

    def close(self) -> None:
        self._stop = True
        self._thread.join()


def start(plan: Sequence, forward: Callable, batch_shape: tuple[int, int]) -> ReferenceAhead:
    """A `ReferenceAhead` over `plan`, writing into a new zeroed float32 tensor of `batch_shape`."""
    return ReferenceAhead(plan, forward, torch.zeros(*batch_shape))


__all__ = ["ReferenceAhead", "start", "usable"]
