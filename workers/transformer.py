"""A real CPU model for benchmarks: a small random-weight Transformer encoder.

It loads nothing from the network: the weights come from a fixed seed, so every worker
process builds the same model. An item is a sequence of token ids; the output is the mean
of the encoder's last layer (one float32 vector per item).
"""
from __future__ import annotations

from typing import Any

from rstreamer.model import ManagedModel

D_MODEL = 256
LAYERS = 4
HEADS = 4
SEQUENCE = 32
VOCAB = 1000
SEED = 0


def example_item(n: int = 0) -> list[int]:
    """A deterministic input item: ``SEQUENCE`` token ids."""
    return [(n * 7 + i * 13) % VOCAB for i in range(SEQUENCE)]


class TransformerModel(ManagedModel):
    """A 4-layer ``nn.TransformerEncoder`` (d_model 256) on token-id sequences of length 32.

    ``init_model(threads=1)``: torch intra-op threads of this process; one per worker keeps
    worker processes from fighting over the same cores.
    """

    def init_model(self, threads: int = 1, *args: Any, **kwargs: Any) -> None:
        """Build the model with a fixed seed and set the process's torch threads."""
        import torch
        from torch import nn

        torch.set_num_threads(threads)
        torch.manual_seed(SEED)
        self.torch = torch
        self.embedding = nn.Embedding(VOCAB, D_MODEL)
        layer = nn.TransformerEncoderLayer(D_MODEL, HEADS, dim_feedforward=4 * D_MODEL, batch_first=True)
        # enable_nested_tensor only matters for padded batches; ours are dense.
        self.model = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False).eval()

    def predict(self, batch: list[Any]) -> list[Any]:
        """One float32 numpy vector of 256 per item (the mean over the sequence)."""
        torch = self.torch
        with torch.inference_mode():
            tokens = torch.tensor(batch, dtype=torch.long)
            hidden = self.model(self.embedding(tokens))
            # numpy rows travel as raw bytes (codec ext type), not as 256 msgpack floats.
            return list(hidden.mean(dim=1).numpy())
