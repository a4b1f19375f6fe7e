"""A real CPU model for benchmarks: a small random-weight Transformer encoder.

It loads nothing from the network: the weights come from a fixed seed, so every worker
process builds the same model. An item is a sequence of token ids; the output is the mean
of the encoder's last layer (one float32 vector per item). Items of different lengths are
padded to the longest of their batch and masked, as a real encoder does, so a batch costs
``len(batch) * longest``: :class:`PaddedTransformerModel` tells the worker so (``cost``).
An item that is not a list of token ids, or longer than ``MAX_TOKENS`` (attention costs the
square of the length), is refused with :class:`~rstreamer.InvalidInput` (HTTP 400).
"""
from __future__ import annotations

from typing import Any

from rstreamer.errors import InvalidInput
from rstreamer.model.managed import ManagedModel

D_MODEL = 256
LAYERS = 4
HEADS = 4
SEQUENCE = 32
VOCAB = 1000
SEED = 0
#: Longest item accepted, in tokens.
MAX_TOKENS = 2048


def check_item(item: Any) -> list[int]:
    """``item`` as a list of token ids, or InvalidInput saying why it is not one the model takes."""
    if not isinstance(item, (list, tuple)) or not item:
        raise InvalidInput(f"expected a non-empty list of token ids, got {type(item).__name__}")
    if len(item) > MAX_TOKENS:
        raise InvalidInput(f"{len(item)} tokens refused: at most {MAX_TOKENS}")
    if not all(isinstance(token, int) and not isinstance(token, bool) and 0 <= token < VOCAB for token in item):
        raise InvalidInput(f"token ids must be integers from 0 to {VOCAB - 1}")
    return list(item)


def example_item(n: int = 0) -> list[int]:
    """A deterministic input item: ``SEQUENCE`` token ids."""
    return [(n * 7 + i * 13) % VOCAB for i in range(SEQUENCE)]


def varied_item(length: int, n: int = 0) -> list[int]:
    """A deterministic input item of ``length`` token ids (ids start at 1: 0 pads)."""
    return [1 + (n * 7 + i * 13) % (VOCAB - 1) for i in range(length)]


class TransformerModel(ManagedModel):
    """A ``nn.TransformerEncoder`` (default: 4 layers, d_model 256) on token-id sequences.

    ``init_model(threads=1, d_model=256, layers=4, oom_above=None, output="vector")``:
    ``threads``, torch intra-op threads of this process (one per worker keeps worker
    processes from fighting over the same cores); ``oom_above``, raise torch's
    OutOfMemoryError for a batch over that many padded tokens, like a GPU with that much
    memory (the worker is not told); ``output="padded_length"`` answers each item with the
    length its batch was padded to instead of a vector (for the padding share of a benchmark).
    """

    def init_model(self, threads: int = 1, d_model: int = D_MODEL, layers: int = LAYERS,
                   oom_above: int | None = None, output: str = "vector", **kwargs: Any) -> None:
        """Build the model with a fixed seed and set the process's torch threads."""
        import torch
        from torch import nn

        torch.set_num_threads(threads)
        torch.manual_seed(SEED)
        self.torch = torch
        self.oom_above = oom_above
        self.output = output
        self.embedding = nn.Embedding(VOCAB, d_model, padding_idx=0)
        layer = nn.TransformerEncoderLayer(d_model, HEADS, dim_feedforward=4 * d_model, batch_first=True)
        # No nested tensors: a padded batch really costs len(batch) * longest, as on a GPU.
        self.model = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False).eval()

    def predict(self, batch: list[Any]) -> list[Any]:
        """One float32 numpy vector per item (the mean over its own tokens)."""
        torch = self.torch
        batch = [check_item(item) for item in batch]
        longest = max(len(item) for item in batch)
        if self.oom_above is not None and len(batch) * longest > self.oom_above:
            raise torch.OutOfMemoryError(
                f"out of memory: a batch of {len(batch)} x {longest} tokens is over {self.oom_above}")
        with torch.inference_mode():
            tokens = torch.tensor([list(item) + [0] * (longest - len(item)) for item in batch], dtype=torch.long)
            padding = tokens == 0
            hidden = self.model(self.embedding(tokens), src_key_padding_mask=padding if padding.any() else None)
            if self.output == "padded_length":
                return [longest] * len(batch)
            real = (~padding).unsqueeze(-1)
            means = (hidden * real).sum(dim=1) / real.sum(dim=1)
            # numpy rows travel as raw bytes (codec ext type), not as msgpack floats.
            return list(means.numpy())


class PaddedTransformerModel(TransformerModel):
    """TransformerModel that tells the worker what an item costs: its number of tokens, so
    batches close on ``--max-batch-cost`` and similar lengths batch together."""

    def cost(self, item: Any) -> int:
        """The item's number of tokens (1 for an item predict refuses)."""
        return max(1, len(item)) if isinstance(item, (list, tuple)) and len(item) <= MAX_TOKENS else 1
