"""Driver-side objects that the loops call like one Ray actor: `group.method.remote(...)`.

Job: the calling convention shared by `PolicyGroup` (data-parallel trainers) and
`GeneratorGroup` (data-parallel engines), so a loop drives one actor or N the same way.
A group method fans out to its actors, combines their answers and returns one ObjectRef.
Boundary: no knowledge of what the actors compute.
"""

from __future__ import annotations


class _RemoteCall:
    """`group.method.remote(*args)`: the actor-handle calling convention for a group method."""

    def __init__(self, group, fn) -> None:
        self._group, self._fn = group, fn

    def remote(self, *args, **kwargs):
        return self._fn(self._group, *args, **kwargs)


class remote_method:  # noqa: N801 - used as a decorator, named like one
    """Marks a group method as called with `.remote(...)`; the method returns an ObjectRef."""

    def __init__(self, fn) -> None:
        self._fn = fn
        self.__doc__ = fn.__doc__

    def __get__(self, group, owner=None):
        return self if group is None else _RemoteCall(group, self._fn)


def split_rows(n: int, parts: int) -> list[slice]:
    """Contiguous, near-equal row ranges, one per member (empty ranges when n < parts)."""
    bounds = [n * r // parts for r in range(parts + 1)]
    return [slice(bounds[r], bounds[r + 1]) for r in range(parts)]
