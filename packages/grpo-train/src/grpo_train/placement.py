"""Where Ray puts an actor, and a way to look without starting the real thing.

Every actor grpo places (policy and value ranks, generation engines) is made a Ray class through
`actor_class`. A placement test sets `PROBE = True` in its driver: the same placement groups,
bundles and options are then used to start `PlacementProbe`s, whose __init__ loads nothing and
whose `where()` reports the node, the bundle and the devices Ray gave them. No CUDA is touched.
"""

from __future__ import annotations

import os
from typing import Any

PROBE = False
"""Set by placement tests (in the driver): start probes in place of the real actors."""


def actor_class(cls: type, **remote_kwargs: Any):
    """`ray.remote(cls)` (with `remote_kwargs`), or a probe standing in for `cls` when PROBE is set."""
    import ray

    if PROBE:
        return _ProbeOf(ray.remote(PlacementProbe), cls.__name__)
    return ray.remote(**remote_kwargs)(cls) if remote_kwargs else ray.remote(cls)


class _ProbeOf:
    """`.options(...).remote(*args)` as on a Ray class; the probe records which class it stands for."""

    def __init__(self, remote_cls, name: str) -> None:
        self.remote_cls, self.name = remote_cls, name

    def options(self, **options):
        return _ProbeOf(self.remote_cls.options(**options), self.name)

    def remote(self, *args, **kwargs):
        return self.remote_cls.remote(self.name)


class PlacementProbe:
    """Stands where a real actor would; loads nothing."""

    def __init__(self, role: str = "", *args: Any, **kwargs: Any) -> None:
        self.role = role

    def ready(self) -> bool:
        return True

    def where(self) -> dict:
        import ray
        from ray._private.utils import PLACEMENT_GROUP_INDEXED_BUNDLED_RESOURCE_PATTERN as INDEXED

        ctx = ray.get_runtime_context()
        # The placement-group form of the resources (e.g. GPU_group_3_<pg>) names the bundle; the
        # public get_assigned_resources() folds it back into plain names.
        raw = ray._private.worker.global_worker.core_worker.resource_ids()
        bundles = sorted({int(m.group(2)) for key in raw if (m := INDEXED.match(key)) and m.group(1) != "bundle"})
        return {
            "role": self.role,
            "node_id": ctx.get_node_id(),
            "bundles": bundles,
            "placement_group": ctx.get_placement_group_id(),
            "gpus": ctx.get_assigned_resources().get("GPU", 0.0),
            "gpu_ids": [str(i) for i in ray.get_gpu_ids()],
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        }
