"""Continuous batching for a Hugging Face causal LM: a KV cache that sequences join and leave.

:class:`SlotCache` holds the keys and values of every live sequence in one tensor per layer,
``[layers, rows, kv_heads, columns, head_dim]``: one row per sequence, right-aligned so that
every row writes its next token in the same column. A decoding step is then one forward pass
of the model over a ``[rows, 1]`` batch; the attention mask hides the columns before each
row's first token, and each row's position ids count from its own first token, so a sequence
computes what it would compute alone (up to float rounding).

Sequences join between steps: :class:`BatchRunner.prefill` runs their prompts (left-padded
among themselves) and copies their keys and values into free rows, right-aligned at the
current column. A sequence that leaves frees its row: the last row moves into it, copying
only its valid columns, so the live rows stay ``0..n-1`` and a step never gathers the cache.
Columns nobody attends to any more are dropped when the cache runs out of columns (amortised:
the window is compacted, and the tensors double only when the live window fills half of them).

The model's own forward (``transformers``' Llama) runs unchanged: this cache is passed as its
``cache`` (it has the ``update(key, value, layer_idx)`` the attention layers call) with a
prepared 4-D boolean mask, which ``transformers`` uses as is.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

PREFILL_TOKENS = 2048
"""Most tokens (padding included) of one prefill forward pass: a larger group is split."""


class SlotCache:
    """The keys and values of the live sequences, one right-aligned row each (see the module doc)."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float32,
                 rows: int = 8, columns: int = 128, device: torch.device | str = "cpu") -> None:
        self._shape = (layers, kv_heads, head_dim)
        self._dtype = dtype
        self.device = torch.device(device)
        self._initial = (rows, columns)
        self.keys, self.values = self._alloc(rows, columns)
        self.starts: list[int] = []  # per live row: the column of its first token
        self.end = 0  # the column the next decoding step writes, the same for every row

    # sizes ---------------------------------------------------------------------------------

    @property
    def rows(self) -> int:
        """Live sequences (rows ``0..rows-1``)."""
        return len(self.starts)

    @property
    def left(self) -> int:
        """The first column any live row attends to."""
        return min(self.starts, default=self.end)

    @property
    def window(self) -> int:
        """Columns a decoding step attends to (the longest live sequence, plus the new token)."""
        return self.end - self.left + 1

    def lengths(self) -> list[int]:
        """Tokens in the cache per live row."""
        return [self.end - start for start in self.starts]

    # the interface transformers' attention layers call ---------------------------------------

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Store a decoding step's key and value (``[rows, heads, 1, dim]``) in column ``end``;
        return every row's keys and values over the live window."""
        n, left = self.rows, self.left
        self.keys[layer_idx, :n, :, self.end] = key[:, :, 0]
        self.values[layer_idx, :n, :, self.end] = value[:, :, 0]
        return self.keys[layer_idx, :n, :, left:self.end + 1], self.values[layer_idx, :n, :, left:self.end + 1]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Columns before the new token (transformers asks when it is not given position ids)."""
        return self.window - 1

    # one decoding step ---------------------------------------------------------------------

    def decode_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Position ids ``[rows, 1]`` and the boolean attention mask ``[rows, 1, 1, window]`` of
        the next decoding step; makes room for its column first."""
        self._reserve_column()
        starts = torch.tensor(self.starts, device=self.device)
        positions = (self.end - starts).unsqueeze(1)
        columns = torch.arange(self.left, self.end + 1, device=self.device)
        mask = columns.unsqueeze(0) >= starts.unsqueeze(1)
        return positions, mask[:, None, None, :]

    def advance(self) -> None:
        """The decoding step ran: every row has one more token."""
        self.end += 1

    # joining and leaving ---------------------------------------------------------------------

    def join(self, layers: Sequence[tuple[torch.Tensor, torch.Tensor]], lengths: Sequence[int]) -> None:
        """Add one row per prefilled sequence: ``layers`` holds each layer's ``[m, heads, C, dim]``
        keys and values of ``m`` left-padded prompts, ``lengths`` their real lengths (at most C)."""
        width = max(lengths, default=0)
        if self.rows == 0:
            self.end = 0  # nothing to keep: start over at the first column
        if self.end < width:
            self._end_at(width)
        self._reserve_rows(self.rows + len(lengths))
        self._reserve_column()
        for j, length in enumerate(lengths):
            row, start = self.rows, self.end - length
            if length:
                for layer, (key, value) in enumerate(layers):
                    self.keys[layer, row, :, start:self.end] = key[j, :, key.shape[2] - length:]
                    self.values[layer, row, :, start:self.end] = value[j, :, value.shape[2] - length:]
            self.starts.append(start)

    def remove(self, row: int) -> int | None:
        """Free ``row``; the last row moves into it. Returns the row that moved (now ``row``),
        or None when ``row`` was the last one."""
        last = self.rows - 1
        moved: int | None = None
        if row != last:
            start = self.starts[last]
            self.keys[:, row, :, start:self.end] = self.keys[:, last, :, start:self.end]
            self.values[:, row, :, start:self.end] = self.values[:, last, :, start:self.end]
            self.starts[row] = start
            moved = last
        self.starts.pop()
        if not self.starts:
            self._reset()
        return moved

    # memory ----------------------------------------------------------------------------------

    def _alloc(self, rows: int, columns: int) -> tuple[torch.Tensor, torch.Tensor]:
        layers, heads, dim = self._shape
        shape = (layers, rows, heads, columns, dim)
        return (torch.zeros(shape, dtype=self._dtype, device=self.device),
                torch.zeros(shape, dtype=self._dtype, device=self.device))

    def _reset(self) -> None:
        """Empty: go back to the first column, and to the initial size if the cache had grown."""
        self.end = 0
        if tuple(self.keys.shape[1:4:2]) != self._initial:
            self.keys, self.values = self._alloc(*self._initial)

    def _resize(self, rows: int, columns: int, shift: int = 0) -> None:
        """New tensors of this size; the live window moves to start at column ``shift``."""
        keys, values = self._alloc(rows, columns)
        n, left = self.rows, self.left
        keys[:, :n, :, shift:shift + self.end - left] = self.keys[:, :n, :, left:self.end]
        values[:, :n, :, shift:shift + self.end - left] = self.values[:, :n, :, left:self.end]
        self.keys, self.values = keys, values
        self.starts = [start - left + shift for start in self.starts]
        self.end = self.end - left + shift

    def _reserve_rows(self, rows: int) -> None:
        capacity, columns = self.keys.shape[1], self.keys.shape[3]
        if rows > capacity:
            self._resize(max(rows, 2 * capacity), columns, shift=self.left)

    def _reserve_column(self) -> None:
        """Make column ``end`` writable: drop the columns left of the window, and double the
        columns when the window fills more than half of them."""
        capacity, columns = self.keys.shape[1], self.keys.shape[3]
        if self.end < columns:
            return
        grown = columns * 2 if 2 * self.window > columns else columns
        self._resize(capacity, grown)

    def _end_at(self, end: int) -> None:
        """Move every row right so that the next column is ``end`` (a joining prompt has ``end``
        tokens, more than there are columns left of the next one)."""
        capacity, columns = self.keys.shape[1], self.keys.shape[3]
        self._resize(capacity, max(columns, _pow2(end + 1)), shift=end - (self.end - self.left))


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class PrefillCache:
    """The cache of one prefill pass: keeps each layer's keys and values of the prompts as they are."""

    def __init__(self) -> None:
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Record the layer's keys and values; the prompts attend only to themselves."""
        self.layers.append((key, value))
        return key, value

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Nothing came before the prompts."""
        return 0


def plan_prefill(prompts: Sequence[list[int]], budget: int = PREFILL_TOKENS) -> list[list[int]]:
    """Indices of ``prompts`` grouped for prefill passes: similar lengths together (little
    padding), each group within ``budget`` tokens with its padding (one prompt alone may exceed it)."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    groups: list[list[int]] = []
    for index in order:
        width = len(prompts[index])  # sorted: the widest of its group so far
        if groups and (len(groups[-1]) + 1) * max(width, 1) <= budget:
            groups[-1].append(index)
        else:
            groups.append([index])
    return groups


def _check_cache_argument(model: Any) -> None:
    """Refuse a model whose forward takes no ``cache`` argument (transformers before it was named
    so): it would swallow the cache in ``**kwargs`` and every decoding step would fail on shapes."""
    import inspect

    if "cache" not in inspect.signature(model.forward).parameters:
        import transformers

        raise RuntimeError(f"this transformers ({transformers.__version__}) passes the KV cache under another "
                           "name than `cache`: install the version the llm extra pins (pip install -e '.[llm]')")


class BatchRunner:
    """Runs a transformers causal LM over a :class:`SlotCache`: prefill new sequences, decode all."""

    def __init__(self, model: Any) -> None:
        _check_cache_argument(model)
        config = model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        weight = next(model.parameters())
        self.model = model
        self.cache = SlotCache(config.num_hidden_layers, config.num_key_value_heads, head_dim,
                               dtype=weight.dtype, device=weight.device)

    def prefill(self, prompts: Sequence[list[int]]) -> None:
        """Run the prompts (already tokenized) and add them to the cache, in this order, as the
        rows after the live ones. An empty prompt adds a row with nothing cached."""
        per_prompt: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in prompts]
        for group in plan_prefill(prompts):
            layers = self._prefill_group([prompts[i] for i in group])
            for j, index in enumerate(group):
                per_prompt[index] = [(key[j:j + 1], value[j:j + 1]) for key, value in layers]
        for index, prompt in enumerate(prompts):
            self.cache.join(per_prompt[index], [len(prompt)])

    def _prefill_group(self, prompts: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        width = max(len(prompt) for prompt in prompts)
        if width == 0:
            return []
        device = self.cache.device
        pads = torch.tensor([width - len(prompt) for prompt in prompts], device=device)
        ids = torch.tensor([[0] * (width - len(prompt)) + prompt for prompt in prompts], device=device)
        columns = torch.arange(width, device=device)
        positions = (columns.unsqueeze(0) - pads.unsqueeze(1)).clamp(min=0)
        causal = columns.unsqueeze(0) <= columns.unsqueeze(1)  # [query, key]
        real = columns.unsqueeze(0) >= pads.unsqueeze(1)  # [row, key]
        # A padding query attends to itself: no empty row.
        diagonal = torch.eye(width, dtype=torch.bool, device=device)
        mask = (causal.unsqueeze(0) & real.unsqueeze(1)) | diagonal.unsqueeze(0)
        cache = PrefillCache()
        with torch.inference_mode():
            self.model(input_ids=ids, position_ids=positions, attention_mask=mask[:, None], cache=cache,
                       use_cache=True, logits_to_keep=1)
        return cache.layers

    def decode(self, tokens: Sequence[int]) -> torch.Tensor:
        """One decoding step: feed each live row its token; the next-token logits ``[rows, vocab]``
        (float32)."""
        positions, mask = self.cache.decode_inputs()
        ids = torch.tensor(tokens, device=self.cache.device).unsqueeze(1)
        with torch.inference_mode():
            out = self.model(input_ids=ids, position_ids=positions, attention_mask=mask, cache=self.cache,
                             use_cache=True)
        self.cache.advance()
        return out.logits[:, -1].float()

    def remove(self, row: int) -> int | None:
        """Free a row (see :meth:`SlotCache.remove`)."""
        return self.cache.remove(row)
