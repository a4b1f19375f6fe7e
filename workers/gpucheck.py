"""Models for `rstreamer bench gpu`: each tells where it ran, so that a check on a real GPU sees the
placement, out-of-memory recovery and the shelf's GPU memory from the answers alone.

They run on the CPU too (the bench's own test does), where ``cuda`` is simply absent from the
answers. torch is imported when a model is built, not with this module.
"""
from __future__ import annotations

import os
import time
from typing import Any

from rstreamer.model.managed import ManagedModel


def _torch() -> Any:
    import torch  # a model's own dependency, imported where it is built

    return torch


def device() -> str:
    """``cuda`` where torch sees a GPU, else ``cpu``."""
    return "cuda" if _torch().cuda.is_available() else "cpu"


def allocated() -> int:
    """Bytes of live CUDA tensors in this process (0 without a GPU)."""
    torch = _torch()
    return int(torch.cuda.memory_allocated()) if torch.cuda.is_available() else 0


class Probe(ManagedModel):
    """Answers each item with where its process runs: ``gpu_id``, ``CUDA_VISIBLE_DEVICES``, the
    devices torch sees, the device of a tensor it made, the GPU's name and the pid."""

    def init_model(self) -> None:
        """Make one tensor on the device torch would use."""
        torch = _torch()
        tensor = torch.ones(1024, device=device())
        self.where = {"gpu_id": self.gpu_id, "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
                      "devices": torch.cuda.device_count(), "device": str(tensor.device),
                      "name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                      "pid": os.getpid()}

    def predict(self, batch: list[Any]) -> list[Any]:
        """Where this process runs, once per item."""
        return [dict(self.where, item=item) for item in batch]


class Gibibytes(ManagedModel):
    """Each item is a number of GiB; a batch allocates their sum on the device and answers each
    item with the batch's size: too big a batch is a real out-of-memory error."""

    def init_model(self) -> None:
        """Nothing to load."""
        self.pid = os.getpid()

    def predict(self, batch: list[Any]) -> list[Any]:
        """Allocate and touch the batch's GiB, then let them go."""
        torch = _torch()
        block = torch.empty(sum(int(item) for item in batch) << 30, dtype=torch.uint8, device=device())
        block[:: 1 << 20].fill_(1)
        del block
        return [{"gib": item, "batch": len(batch), "pid": self.pid} for item in batch]


class Resident(ManagedModel):
    """Holds ``gib`` GiB on the device while loaded (a shelf model of that size); answers with its
    ``seed`` and the process's live CUDA bytes."""

    def init_model(self, gib: float = 2.0, seed: int = 0) -> None:
        """Allocate its GiB."""
        torch = _torch()
        self.block = torch.ones(int(gib * (1 << 30)), dtype=torch.uint8, device=device())
        self.seed = seed

    def predict(self, batch: list[Any]) -> list[Any]:
        """Its seed and the process's live CUDA bytes, once per item."""
        return [{"seed": self.seed, "allocated": allocated()} for _ in batch]


class _Timed(ManagedModel):
    """Records how long each ``predict`` ran and the time between the end of one and the start of
    the next: the worker's own time per batch (reading, decoding, replying). An item ``"stats"``
    is answered with the medians of the last 200 batches instead of being run."""

    def _start_timing(self) -> None:
        self._gaps: list[float] = []
        self._runs: list[float] = []
        self._sizes: list[int] = []
        self._ended: float | None = None

    def predict(self, batch: list[Any]) -> list[Any]:
        """The stats asked for, or the batch run and timed."""
        if batch and batch[0] == "stats":
            return [self._stats() for _ in batch]
        started = time.perf_counter()
        if self._ended is not None:
            self._gaps.append(started - self._ended)
        outputs = self.run(batch)
        self._ended = time.perf_counter()
        self._runs.append(self._ended - started)
        self._sizes.append(len(batch))
        return outputs

    def run(self, batch: list[Any]) -> list[Any]:
        raise NotImplementedError

    def _stats(self) -> dict[str, float]:
        def median_ms(values: list[float]) -> float:
            recent = sorted(values[-200:]) or [0.0]
            return round(recent[len(recent) // 2] * 1000, 3)

        sizes = self._sizes[-200:] or [0]
        return {"gap_p50_ms": median_ms(self._gaps), "run_p50_ms": median_ms(self._runs),
                "mean_batch": round(sum(sizes) / len(sizes), 1)}


class Encoder(_Timed):
    """A Transformer encoder (random weights from a fixed seed; fp16 on a GPU): an item is a list of
    token ids (all of one length), its answer the float32 mean of the last layer. The default is
    BERT-base's shape: 12 layers, d_model 768."""

    def init_model(self, d_model: int = 768, layers: int = 12, heads: int = 12) -> None:
        """Build the encoder on the device."""
        torch = _torch()
        torch.manual_seed(0)
        dtype = torch.float16 if device() == "cuda" else torch.float32
        self.embedding = torch.nn.Embedding(30000, d_model).to(device(), dtype)
        layer = torch.nn.TransformerEncoderLayer(d_model, heads, dim_feedforward=4 * d_model, batch_first=True)
        self.model = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False).to(device(), dtype).eval()
        self._start_timing()

    def run(self, batch: list[Any]) -> list[Any]:
        """One vector per item."""
        torch = _torch()
        ids = torch.tensor(batch, device=device())
        with torch.inference_mode():
            return list(self.model(self.embedding(ids)).mean(1).float().cpu().numpy())


class Sleeper(_Timed):
    """A batch takes ``ms`` milliseconds of sleep (a GPU that releases the interpreter while it
    works) and answers ``dim`` float32 zeros per item: the worker's own time without a model."""

    def init_model(self, ms: float = 4.8, dim: int = 768) -> None:
        """Nothing to load."""
        import numpy

        self.ms, self.dim, self.numpy = ms, dim, numpy
        self._start_timing()

    def run(self, batch: list[Any]) -> list[Any]:
        """Sleep, then one vector per item."""
        time.sleep(self.ms / 1000)
        return [self.numpy.zeros(self.dim, self.numpy.float32) for _ in batch]
