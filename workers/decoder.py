"""A real generative model for streaming: a small causal Transformer decoder with a KV cache.

Plain torch, nothing downloaded: the weights come from a fixed seed, so every worker process
builds the same model, and greedy decoding makes every answer deterministic. Text is one token
per character (prompt characters are clipped to ASCII; generated tokens are shown as letters).
An item is ``{"prompt": str, "max_new_tokens": int}``; each step yields one character per live
sequence. A step runs one batched forward pass over every live sequence, attending to its own
cached keys and values, so its time grows with the number of live sequences (and their length)
as a real decoder's does.

:class:`TinyDecoder` is a :class:`~rstreamer.model.generative.GenerativeModel` (continuous batching,
streamed chunks); :class:`RequestLevelDecoder` serves the same model as a plain batch model that
answers a batch when its longest item is done (the baseline of ``rstreamer bench stream``).
"""
from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rstreamer.errors import InvalidInput
from rstreamer.model.generative import GenerativeModel, Step
from rstreamer.model.managed import ManagedModel

VOCAB = 128
D_MODEL = 256
LAYERS = 4
HEADS = 4
MAX_CONTEXT = 320
SEED = 0
BOS = 2
ALPHABET = "etaoin shrdlucmfwypvbgkjqxz.,!?'"  # 32 symbols: generated ids are shown as these


def encode(text: str) -> list[int]:
    """Token ids of a prompt: BOS, then one per character (non-ASCII becomes '?')."""
    return [BOS] + [ord(c) if ord(c) < VOCAB else ord("?") for c in text]


def decode(token: int) -> str:
    """The text of one generated token."""
    return ALPHABET[token % len(ALPHABET)]


def parse_item(item: Any, max_context: int) -> tuple[list[int], int]:
    """The prompt's token ids and max_new_tokens of one item; InvalidInput (a ValueError, HTTP
    400) says what is wrong, before any work: a prompt far beyond the context is not encoded."""
    if not isinstance(item, dict) or not isinstance(item.get("prompt"), str):
        raise InvalidInput('an item is {"prompt": str, "max_new_tokens": int}')
    new = item.get("max_new_tokens", 16)
    if not isinstance(new, int) or isinstance(new, bool) or new < 1:
        raise InvalidInput(f"max_new_tokens must be an integer >= 1, got {new!r}")
    length = len(item["prompt"]) + 1  # what encode() makes of it: BOS, then one token per character
    if length + new > max_context:
        raise InvalidInput(f"prompt ({length} tokens) plus max_new_tokens ({new}) exceed the context of "
                           f"{max_context} tokens")
    return encode(item["prompt"]), new


@dataclass
class _Sequence:
    slot: int
    length: int  # tokens in the cache
    next_token: int  # produced, not yet sent nor fed back
    left: int  # tokens still to produce (next_token included)


class TinyDecoder(GenerativeModel):
    """A random-weight causal Transformer decoder (default 4 layers, d_model 256) with a KV cache.

    ``init_model(threads=1, d_model=256, layers=4, heads=4, max_context=320, sampling=False)``:
    ``threads``, torch intra-op threads of this process; ``sampling``, draw each token at random
    (temperature 1, an unseeded generator) instead of greedily, which makes the model
    non-deterministic (a restarted item then starts over, with a Restarted marker).
    """

    def init_model(self, threads: int = 1, d_model: int = D_MODEL, layers: int = LAYERS, heads: int = HEADS,
                   max_context: int = MAX_CONTEXT, sampling: bool = False) -> None:
        """Build the weights from a fixed seed."""
        import torch
        from torch import nn

        torch.set_num_threads(threads)
        torch.manual_seed(SEED)
        self.torch = torch
        self.heads, self.head_dim, self.layers = heads, d_model // heads, layers
        self.max_context = max_context
        self.deterministic = not sampling
        self.sampler = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1) if sampling else None
        self.embed = nn.Embedding(VOCAB, d_model)
        self.position = nn.Embedding(max_context, d_model)
        self.blocks = nn.ModuleList(_block(nn, d_model) for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB)
        self.model = nn.ModuleList([self.embed, self.position, self.blocks, self.norm, self.head]).eval()
        self.sequences: dict[int, _Sequence] = {}
        self.k_cache = self.v_cache = torch.zeros(0)
        self._grow(8)

    # the GenerativeModel contract --------------------------------------------------------

    def start(self, items: Mapping[int, Any]) -> None:
        """Run each prompt through the model, filling its KV cache; raises ValueError for a bad item."""
        parsed = {key: parse_item(item, self.max_context) for key, item in items.items()}  # all or none
        for key, (tokens, new) in parsed.items():
            slot = self._slot()
            logits = self._prefill(tokens, slot)
            self.sequences[key] = _Sequence(slot, len(tokens), self._choose(logits)[0], new)

    def step(self) -> dict[int, Step]:
        """One character per live sequence; a sequence that still has tokens to make is fed its
        character back in one batched forward pass."""
        out: dict[int, Step] = {}
        going: list[int] = []
        for key, seq in list(self.sequences.items()):
            seq.left -= 1
            out[key] = Step([decode(seq.next_token)], finished=seq.left == 0)
            if seq.left == 0:
                self._release(key)
            else:
                going.append(key)
        if going:
            seqs = sorted((self.sequences[key] for key in going), key=lambda seq: seq.slot)
            logits = self._decode_step(seqs)
            for seq, token in zip(seqs, self._choose(logits), strict=True):
                seq.length += 1
                seq.next_token = token
        return out

    def cancel(self, keys: Sequence[int]) -> None:
        """Free the cache slots of these sequences."""
        for key in keys:
            if key in self.sequences:
                self._release(key)

    def cost(self, item: Any) -> int:
        """The KV cache an item needs: prompt plus output tokens."""
        try:
            tokens, new = parse_item(item, self.max_context)
        except (TypeError, ValueError):
            return 1  # start() refuses it with the reason
        return len(tokens) + new

    # the network --------------------------------------------------------------------------

    def _prefill(self, tokens: list[int], slot: int) -> Any:
        """Causal attention over the whole prompt; keys and values go to the slot's cache."""
        torch = self.torch
        with torch.inference_mode():
            ids = torch.tensor(tokens)
            x = self.embed(ids) + self.position(torch.arange(len(tokens)))
            causal = torch.ones(len(tokens), len(tokens), dtype=torch.bool).tril()
            for layer, block in enumerate(self.blocks):
                q, k, v = self._qkv(block, x)  # (P, H, hd) each
                self.k_cache[layer, slot, :, :len(tokens)] = k.transpose(0, 1)
                self.v_cache[layer, slot, :, :len(tokens)] = v.transpose(0, 1)
                scores = q.transpose(0, 1) @ k.permute(1, 2, 0) / math.sqrt(self.head_dim)  # (H, P, P)
                weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)
                x = self._finish_block(block, x, (weights @ v.transpose(0, 1)).transpose(0, 1))
            return self.head(self.norm(x[-1:]))

    def _decode_step(self, seqs: list[_Sequence]) -> Any:
        """One token per sequence, each attending to its own cache: (B, VOCAB) logits.

        ``seqs`` hold the slots 0..B-1 in order (see :meth:`_release`), so each layer's cache
        of the batch is a view, not a copy of every live sequence's keys and values.
        """
        torch = self.torch
        with torch.inference_mode():
            count = len(seqs)
            slots = torch.arange(count)
            positions = torch.tensor([seq.length for seq in seqs])
            span = int(positions.max()) + 1
            x = self.embed(torch.tensor([seq.next_token for seq in seqs])) + self.position(positions)
            visible = torch.arange(span)[None, :] <= positions[:, None]  # (B, span)
            for layer, block in enumerate(self.blocks):
                q, k, v = self._qkv(block, x)  # (B, H, hd) each
                self.k_cache[layer, slots, :, positions] = k
                self.v_cache[layer, slots, :, positions] = v
                keys = self.k_cache[layer, :count, :, :span]  # (B, H, span, hd), a view
                values = self.v_cache[layer, :count, :, :span]
                scores = (keys @ q.unsqueeze(-1)).squeeze(-1) / math.sqrt(self.head_dim)  # (B, H, span)
                weights = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)
                x = self._finish_block(block, x, (weights.unsqueeze(2) @ values).squeeze(2))
            return self.head(self.norm(x))

    def _qkv(self, block: Any, x: Any) -> tuple[Any, Any, Any]:
        q, k, v = block["qkv"](block["norm1"](x)).view(x.shape[0], 3, self.heads, self.head_dim).unbind(1)
        return q, k, v

    def _finish_block(self, block: Any, x: Any, attended: Any) -> Any:
        x = x + block["out"](attended.reshape(x.shape[0], -1))
        return x + block["mlp"](block["norm2"](x))

    def _choose(self, logits: Any) -> list[int]:
        if self.sampler is None:
            return [int(t) for t in logits.argmax(-1)]
        probabilities = logits.softmax(-1)
        return [int(t) for t in self.torch.multinomial(probabilities, 1, generator=self.sampler).squeeze(-1)]

    # cache slots ---------------------------------------------------------------------------

    def _slot(self) -> int:
        if len(self.sequences) == self.k_cache.shape[1]:
            self._grow(2 * self.k_cache.shape[1])
        return len(self.sequences)

    def _release(self, key: int) -> None:
        """Free a sequence's slot; the last live slot moves into it, so the live ones stay 0..n-1."""
        slot = self.sequences.pop(key).slot
        last = len(self.sequences)
        if slot != last:
            mover = next(seq for seq in self.sequences.values() if seq.slot == last)
            self.k_cache[:, slot], self.v_cache[:, slot] = self.k_cache[:, last], self.v_cache[:, last]
            mover.slot = slot

    def _grow(self, slots: int) -> None:
        """Room for ``slots`` sequences (the cache doubles when full)."""
        torch = self.torch
        old = self.k_cache.shape[1] if self.k_cache.dim() == 5 else 0
        shape = (self.layers, slots, self.heads, self.max_context, self.head_dim)
        k, v = torch.zeros(shape), torch.zeros(shape)
        if old:
            k[:, :old], v[:, :old] = self.k_cache, self.v_cache
        self.k_cache, self.v_cache = k, v


def _block(nn: Any, d_model: int) -> Any:
    return nn.ModuleDict({
        "norm1": nn.LayerNorm(d_model), "qkv": nn.Linear(d_model, 3 * d_model), "out": nn.Linear(d_model, d_model),
        "norm2": nn.LayerNorm(d_model),
        "mlp": nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)),
    })


class RequestLevelDecoder(ManagedModel):
    """:class:`TinyDecoder` served as a plain batch model: a batch runs as one static batch,
    every sequence computed until the longest is done (as a padded ``generate`` does), and
    every item is answered then, whole. Takes TinyDecoder's init arguments."""

    def init_model(self, **kwargs: Any) -> None:
        """Build the TinyDecoder."""
        self.decoder = TinyDecoder(self.gpu_id)
        self.decoder.init_model(**kwargs)

    def predict(self, batch: list[Any]) -> list[Any]:
        """The whole answer of each item, once the longest of the batch is done."""
        wanted = [parse_item(item, self.decoder.max_context)[1] for item in batch]
        longest = max(wanted)
        padded = [{**item, "max_new_tokens": longest} for item in batch]
        answers = self.decoder.predict(padded)
        return [answer[:n] for answer, n in zip(answers, wanted, strict=True)]
