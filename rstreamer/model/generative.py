"""The contract of a generative model: live sequences advanced one step at a time.

A :class:`GenerativeModel` answers an item piece by piece (a token, a word, a frame of audio).
The worker owns the scheduling (:mod:`rstreamer.batching.scheduler`): between two steps it starts new
items and drops finished, cancelled and expired ones, so a short answer never waits for the
longest one of its batch (continuous batching). The model owns its state (a KV cache): it is
told which sequences to start and which to drop, and each ``step()`` advances every live one.

Sequences are named by integer keys the worker chooses. A model that is served as a plain
batch model (``predict``, e.g. by ``ThreadedStreamer``) runs each batch to completion.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .managed import ManagedModel


@dataclass(frozen=True)
class Step:
    """What one step produced for one live sequence: zero or more chunks, and whether it is done.

    A finished sequence is forgotten by the model itself; it is never named again.
    """

    chunks: Sequence[Any] = field(default_factory=tuple)
    finished: bool = False


class GenerativeModel(ManagedModel):
    """A model that produces each answer in steps (subclass it; see docs/streaming.md).

    Implement :meth:`init_model`, :meth:`start`, :meth:`step` and :meth:`cancel`. ``cost(item)``
    (e.g. prompt plus output tokens: the KV cache it needs) bounds the live sequences with the
    worker's ``max_batch_cost``; ``batch_size`` bounds their number.
    """

    deterministic: bool = True
    """True when the same item always yields the same chunks (greedy decoding). A restarted
    item then resumes where its caller was; a sampling model sets it False, and its callers
    get a :class:`~rstreamer.Restarted` marker before the chunks of the new run."""

    def start(self, items: Mapping[int, Any]) -> None:
        """Start a sequence per ``key: item`` (e.g. run the prompt, fill the KV cache).

        Raise to refuse them (a bad item): the worker then cancels those keys (whatever the call
        started of them before it raised) and starts them one at a time, so only the items that
        raise fail.
        """
        raise NotImplementedError

    def step(self) -> Mapping[int, Step]:
        """Advance every live sequence by one step; a Step per key that produced something or
        finished (a key left out produced nothing this step). If it raises, every live
        sequence fails with the error and is cancelled."""
        raise NotImplementedError

    def cancel(self, keys: Sequence[int]) -> None:
        """Forget these live sequences (their callers left, their deadline passed)."""
        raise NotImplementedError

    def join(self, chunks: list[Any]) -> Any:
        """The whole answer of an item from its chunks, for callers that ``predict()``."""
        return join_chunks(chunks)

    def predict(self, batch: list[Any]) -> list[Any]:
        """Request-level batching: run the batch until its longest item is done, then answer all."""
        keys = list(range(len(batch)))
        self.start(dict(zip(keys, batch, strict=True)))
        chunks: dict[int, list[Any]] = {key: [] for key in keys}
        live = set(keys)
        try:
            while live:
                for key, out in self.step().items():
                    if key in live:
                        chunks[key].extend(out.chunks)
                        if out.finished:
                            live.discard(key)
        finally:
            if live:
                self.cancel(sorted(live))
        return [self.join(chunks[key]) for key in keys]


def join_chunks(chunks: list[Any]) -> Any:
    """Strings and bytes are concatenated, lists chained; anything else stays a list of chunks."""
    if chunks and all(isinstance(chunk, str) for chunk in chunks):
        return "".join(chunks)
    if chunks and all(isinstance(chunk, (bytes, bytearray)) for chunk in chunks):
        return b"".join(chunks)
    if chunks and all(isinstance(chunk, list) for chunk in chunks):
        return [part for chunk in chunks for part in chunk]
    return list(chunks)
