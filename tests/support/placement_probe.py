"""A model that reports where the supervisor placed it, including what CUDA_VISIBLE_DEVICES
was when its module was imported (it must already be set then)."""
from __future__ import annotations

import os
from typing import Any

from rstreamer import ManagedModel

CUDA_AT_IMPORT = os.environ.get("CUDA_VISIBLE_DEVICES")


class PlacementProbe(ManagedModel):
    def init_model(self) -> None:
        pass

    def predict(self, batch: list[Any]) -> list[Any]:
        return [{"cuda_at_import": CUDA_AT_IMPORT, "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
                 "gpu_id": self.gpu_id, "pid": os.getpid()} for _ in batch]
