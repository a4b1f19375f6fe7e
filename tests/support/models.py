"""Small real models for the tests (importable by worker processes via PYTHONPATH)."""
from __future__ import annotations

import os
import time
from typing import Any

from rstreamer import ManagedModel


def double(batch: list[Any]) -> list[Any]:
    return [item * 2 for item in batch]


class Doubler(ManagedModel):
    """x -> 2x; 'boom' raises; 'kill' kills the process; ('sleep', s) sleeps s seconds."""

    def init_model(self, *args: Any, **kwargs: Any) -> None:
        self.delay = float(kwargs.get("delay", 0.0))

    def predict(self, batch: list[Any]) -> list[Any]:
        outputs = []
        for item in batch:
            if isinstance(item, str) and item == "boom":
                raise ValueError("boom is not a number")
            if isinstance(item, str) and item == "kill":
                os._exit(17)
            if isinstance(item, list) and item[:1] == ["sleep"]:
                time.sleep(float(item[1]))
                outputs.append("slept")
                continue
            outputs.append(item * 2)
        if self.delay:
            time.sleep(self.delay)
        return outputs


class WrongLength(ManagedModel):
    def init_model(self) -> None:
        pass

    def predict(self, batch: list[Any]) -> list[Any]:
        return batch[:-1]


class Placement(ManagedModel):
    """Reports where it was placed."""

    def init_model(self) -> None:
        pass

    def predict(self, batch: list[Any]) -> list[Any]:
        return [{"cuda": os.environ.get("CUDA_VISIBLE_DEVICES"), "gpu_id": self.gpu_id, "pid": os.getpid()}
                for _ in batch]


class BrokenInit(ManagedModel):
    def init_model(self) -> None:
        raise RuntimeError("weights not found")


class Recorder(ManagedModel):
    """Doubler that appends every item it runs to a file, to count executions."""

    def init_model(self, path: str, delay: float = 0.0) -> None:
        self.path = path
        self.delay = delay
        self.inner = Doubler()
        self.inner.init_model()

    def predict(self, batch: list[Any]) -> list[Any]:
        outputs = self.inner.predict(batch)
        if self.delay:
            time.sleep(self.delay)
        with open(self.path, "a") as log:
            log.write("".join(f"{item!r}\n" for item in batch))
        return outputs


def echo_outputs(batch: list[Any]) -> list[Any]:
    """Echo; 'tuple-key' answers 8.4 M zeros: they encode (8 MB) but hold more objects than a client
    decodes (64 MiB / 8). (A dict with a tuple key was the example until tuples got a codec.)"""
    return [[0] * 8_400_000 if item == "tuple-key" else item for item in batch]


class Affine(ManagedModel):
    """x -> x * scale + offset: shows which init args and kwargs reached the model."""

    def init_model(self, scale: int = 1, offset: int = 0) -> None:
        self.scale, self.offset = scale, offset

    def predict(self, batch: list[Any]) -> list[Any]:
        return [item * self.scale + self.offset for item in batch]
