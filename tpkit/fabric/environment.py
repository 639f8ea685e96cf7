"""Lightning Fabric cluster environments tpkit adds: Ray Train's workers.

``ray.train.torch.TorchTrainer`` starts the worker processes and the default process
group itself (no torchrun) and gives each worker its ranks through
``ray.train.get_context()``. Lightning's own environments do not recognise that (torch's
``is_torchelastic_launched`` is False there, and ``LightningEnvironment`` derives the
global rank from the node rank and the device count, which Ray does not promise to
match), so ``TPKitStrategy`` uses ``RayEnvironment`` inside a Ray Train worker: the
ranks and sizes are Ray's, and the process group Ray made is adopted, never re-created.
"""
from __future__ import annotations

import os
import sys

from lightning.fabric.plugins.environments import ClusterEnvironment


def ray_train_context():
    """``ray.train.get_context()`` when this process is a Ray Train worker, else None
    (without importing ray when the process never did)."""
    if "ray" not in sys.modules:
        return None
    try:
        import ray.train
        from ray.train.v2._internal.execution.context import get_train_context
        get_train_context()          # raises outside a worker
        return ray.train.get_context()
    except Exception:  # noqa: BLE001 (ray's errors outside a worker differ by version)
        return None


class RayEnvironment(ClusterEnvironment):
    """Ranks and sizes from ``ray.train.get_context()``; Ray creates the processes and the
    default process group (its ``MASTER_ADDR``/``MASTER_PORT``)."""

    def __init__(self, context=None) -> None:
        self._ctx = context or ray_train_context()
        if self._ctx is None:
            raise ValueError("RayEnvironment() outside a Ray Train worker: run it in the "
                             "train_loop_per_worker of ray.train.torch.TorchTrainer")

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return os.environ.get("MASTER_ADDR", "127.0.0.1")

    @property
    def main_port(self) -> int:
        return int(os.environ.get("MASTER_PORT", 0))

    @staticmethod
    def detect() -> bool:
        return ray_train_context() is not None

    def world_size(self) -> int:
        return self._ctx.get_world_size()

    def set_world_size(self, size: int) -> None:
        if size != self.world_size():
            raise ValueError(f"Fabric expects {size} processes (devices x num_nodes) but Ray "
                             f"Train runs {self.world_size()} workers; make them match "
                             "(ScalingConfig(num_workers=...))")

    def global_rank(self) -> int:
        return self._ctx.get_world_rank()

    def set_global_rank(self, rank: int) -> None:
        pass   # Ray's rank is the rank

    def local_rank(self) -> int:
        return self._ctx.get_local_rank()

    def node_rank(self) -> int:
        return self._ctx.get_node_rank()

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        self.set_world_size(num_devices * num_nodes)
