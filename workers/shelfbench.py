"""The small torch models of ``rstreamer bench shelf``: one text classifier per seed.

Each is a real model with a real load cost: ``init_model`` builds its weights from its own seed,
writes them to a checkpoint in memory and loads them back from it (as a model loads from disk),
then runs one warm-up batch. ``predict`` classifies texts: a hashed bag of words, an MLP, an argmax.
Its answer names its seed, so a caller can check which model served it.
"""
from __future__ import annotations

import io
import zlib
from typing import Any

from rstreamer.model.managed import ManagedModel

from .devices import pick_device

FEATURES = 256


def features(text: str) -> list[float]:
    """A hashed bag of the words of ``text`` (the same on every machine: crc32, not hash())."""
    counts = [0.0] * FEATURES
    for word in str(text).lower().split():
        counts[zlib.crc32(word.encode()) % FEATURES] += 1.0
    return counts


class TinyClassifier(ManagedModel):
    """An MLP text classifier built from ``seed``: ``depth`` layers of ``width`` units, ``classes`` labels."""

    def init_model(self, seed: int, width: int = 1024, depth: int = 8, classes: int = 8) -> None:
        """Build the weights from ``seed``, round-trip them through a checkpoint, warm up (on the
        worker's GPU when it has one)."""
        import torch

        torch.set_num_threads(1)  # one core per worker: the bench runs several side by side
        self.device = pick_device(self.gpu_id)
        generator = torch.Generator().manual_seed(int(seed))
        sizes = [FEATURES] + [width] * depth + [classes]
        weights = {f"{i}.weight": torch.randn(sizes[i + 1], sizes[i], generator=generator) / sizes[i] ** 0.5
                   for i in range(len(sizes) - 1)}
        checkpoint = io.BytesIO()
        torch.save(weights, checkpoint)
        checkpoint.seek(0)
        loaded = torch.load(checkpoint, map_location=self.device)
        self.weights = [loaded[f"{i}.weight"] for i in range(len(sizes) - 1)]
        self.seed = int(seed)
        self.predict(["warm up"])

    def predict(self, batch: list[Any]) -> list[Any]:
        """``{"model": seed, "label": int}`` per text."""
        import torch

        with torch.no_grad():
            hidden = torch.tensor([features(text) for text in batch], device=self.device)
            for weight in self.weights[:-1]:
                hidden = torch.relu(hidden @ weight.T)
            labels = (hidden @ self.weights[-1].T).argmax(dim=1).tolist()
        return [{"model": self.seed, "label": int(label)} for label in labels]
