"""Streamed replies: the chunk messages a worker pushes for a streamed call, and how a client
reads them.

A streamed call (``RedisStreamer.stream``) marks itself in its control key
(``Keys.stream_control``) before it enqueues its item; the worker then pushes, after each step
that produced something, one chunk message to the call's reply list::

    {"v": 2, "g": run, "d": deterministic, "c": [[seq, chunk], ...], "e": end, "x": error | None}

``seq`` numbers the chunks of one run of the item from 0; ``run`` names the run (a reclaimed
item runs again, on another worker, under a new run); ``e`` marks the last message, and ``x``
(``[type, message, kind]``) the error that ended it. A client that has chunks up to ``n`` and
sees a new run of a deterministic model checks the new run's chunks below ``n`` against the ones
it has (a digest of each): while they match it yields nothing and carries on after them; at the
first one that differs (batched float arithmetic can change a greedy answer) or if the new run
ends first, it yields :class:`Restarted` and the new run's chunks from the first: never a splice
of two answers. For a model that is not deterministic it yields :class:`Restarted` and starts
over at once. A plain reply message
(``messages.pack_results``) on the same list is a one-shot answer: the error of a dead-lettered
or malformed entry, or the whole answer of a worker that did not see the mark.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..batching.batcher import Failure
from ..codec import core as codec
from ..errors import DecodeError, RStreamerError, remote_error_from
from .messages import WIRE_VERSION
from .replies import decode_reply

STREAMED = b"s"
"""The control key's value while a streamed call wants its chunks."""
CANCELLED = b"c"
"""The control key's value once its caller left: the worker drops the item."""


@dataclass(frozen=True)
class Restarted:
    """Yielded by a stream when its item was restarted (its worker died) and the new run does
    not continue the answer the caller has (the model is not deterministic, or the new run's
    chunks differ from the ones the caller had): the chunks before this marker belong to an
    abandoned run, and the next ones start the answer over. ``discarded``: how many chunks the
    caller had of the abandoned run."""

    discarded: int


def pack_chunks(run: str, deterministic: bool, chunks: Sequence[tuple[int, Any]], end: bool = False,
                failure: Failure | None = None) -> bytes:
    """One chunk message; raises EncodeError when a chunk cannot cross the broker."""
    error = None if failure is None else [failure.type, failure.message, failure.kind]
    return codec.packb({"v": WIRE_VERSION, "g": run, "d": deterministic, "c": [list(pair) for pair in chunks],
                        "e": end or failure is not None, "x": error})


class ChunkReader:
    """What the caller of one streamed call sees, message by message (pure; the streams feed it)."""

    def __init__(self, max_bytes: int = codec.DEFAULT_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self.next_seq = 0  # chunks of the current run the caller has
        self.run: str | None = None
        self.done = False
        self._digests = bytearray()  # DIGEST bytes per chunk the caller has (deterministic runs only)
        self._replay: list[Any] | None = None  # a resumed run's repeats, held back until checked

    def feed(self, data: bytes) -> tuple[list[Any], RStreamerError | None]:
        """The chunks (and Restarted markers) one message brings, in order, and the error that
        ends the stream after them, if any. ``done`` is set once the stream is over."""
        message = codec.unpackb(data, max_bytes=self.max_bytes)
        if isinstance(message, dict) and "c" in message:
            return self._chunks(message)
        self.done = True
        results = decode_reply(data, self.max_bytes)
        if not results:
            raise DecodeError("empty reply to a streamed call")
        outcome = results[0][1]
        if outcome.ok:
            return [outcome.value], None
        failure = outcome.failure or Failure("Error", "unknown failure")
        return [], remote_error_from(failure.type, failure.message, failure.kind)

    def _chunks(self, message: dict[str, Any]) -> tuple[list[Any], RStreamerError | None]:
        out: list[Any] = []
        run, rows, deterministic = str(message.get("g")), message.get("c"), bool(message.get("d"))
        if not isinstance(rows, list):
            raise DecodeError("malformed chunk message")
        if self.run is not None and run != self.run and self.next_seq:
            if deterministic:
                self._replay = []  # check the new run's repeats against what the caller has
            else:
                out += self._start_over([])
        self.run = run
        for row in rows:
            if not (isinstance(row, list) and len(row) == 2 and isinstance(row[0], int)):
                raise DecodeError("malformed chunk row")
            out += self._take(row[0], row[1], deterministic)
        error = message.get("x")
        if message.get("e") or error:
            self.done = True
            if self._replay is not None and not error:
                out += self._start_over(self._replay)  # the new run ended before repeating all of it
        if error:
            if not (isinstance(error, list) and len(error) >= 2):
                raise DecodeError("malformed error in chunk message")
            kind = str(error[2]) if len(error) > 2 else "remote"
            return out, remote_error_from(str(error[0]), str(error[1]), kind)
        return out, None

    def _take(self, seq: int, chunk: Any, deterministic: bool) -> list[Any]:
        """What one chunk row gives the caller."""
        if self._replay is not None:
            return self._check(seq, chunk)
        if seq > self.next_seq:
            raise DecodeError(f"chunk {self.next_seq} of the stream is missing (got {seq})")
        if seq < self.next_seq:
            return []  # a repeat the caller has
        self._keep(chunk, deterministic)
        return [chunk]

    def _check(self, seq: int, chunk: Any) -> list[Any]:
        """A resumed run's repeat: held back while it matches the chunk the caller had."""
        assert self._replay is not None
        if seq != len(self._replay):
            raise DecodeError(f"chunk {len(self._replay)} of the restarted stream is missing (got {seq})")
        self._replay.append(chunk)
        if _digest(chunk) != bytes(self._digests[seq * DIGEST:(seq + 1) * DIGEST]):
            return self._start_over(self._replay)
        if len(self._replay) == self.next_seq:
            self._replay = None  # every repeat matched: the answer goes on after them
        return []

    def _start_over(self, chunks: list[Any]) -> list[Any]:
        """Restarted, then the new run's chunks so far."""
        marker = Restarted(self.next_seq)
        self._replay = None
        self._digests = bytearray()
        self.next_seq = 0
        for chunk in chunks:
            self._keep(chunk, True)
        return [marker, *chunks]

    def _keep(self, chunk: Any, deterministic: bool) -> None:
        self.next_seq += 1
        if deterministic:
            self._digests += _digest(chunk)


DIGEST = 8
"""Bytes of the digest a stream keeps of each chunk it has yielded, to check a resumed run's repeats."""


def _digest(chunk: Any) -> bytes:
    return hashlib.blake2b(codec.packb(chunk), digest_size=DIGEST).digest()
