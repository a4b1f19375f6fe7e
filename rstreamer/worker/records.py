"""The worker's records: an entry as read, a parsed entry, an answer to its caller, a dead letter,
and the worker's counters. Shared by the loop and its lanes (the generative lane builds them too).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..batching.batcher import BatchStats, Outcome
from ..wire.messages import WIRE_VERSION, MalformedEntry, Request

Entry = tuple[bytes, "dict[bytes, bytes] | None"]
"""A stream entry as read: its id and fields (None for an entry deleted since it was delivered)."""


def field_dict(flat: list[bytes] | None) -> dict[bytes, bytes] | None:
    """An entry's flat ``[field, value, ...]`` list (as scripts return it) as a dict."""
    return None if flat is None else dict(zip(flat[::2], flat[1::2], strict=True))


def read_new(group: str, consumer: str, count: int, streams: Sequence[str], block: int | None = None) -> list[Any]:
    """XREADGROUP of up to ``count`` new entries ('>') of each of ``streams``, as written on a
    connection, waiting up to ``block`` ms for the first (None: not at all)."""
    read: list[Any] = ["XREADGROUP", "GROUP", group, consumer, "COUNT", count]
    if block is not None:
        read += ["BLOCK", block]
    return [*read, "STREAMS", *streams, *[">"] * len(streams)]


def entries_by_stream(reply: Any) -> list[tuple[bytes, list[Entry]]]:
    """XREADGROUP's reply as Redis sends it ({stream: entries} in RESP3, [[stream, entries]] in
    RESP2, None when nothing came; an entry is [id, [field, value, ...]]): each stream that had
    entries, with them."""
    pairs = reply.items() if isinstance(reply, dict) else reply or []
    return [(stream, [(entry_id, field_dict(flat)) for entry_id, flat in rows]) for stream, rows in pairs]


def stream_entries(reply: Any) -> list[Entry]:
    """The entries of XREADGROUP's reply, every stream's (see :func:`entries_by_stream`)."""
    return [entry for _, entries in entries_by_stream(reply) for entry in entries]


# Not frozen: one is built per item on the hot path, and a frozen dataclass's __init__ costs
# four times a plain one's (issue 26). Treat it as immutable all the same.
@dataclass(slots=True)
class Answer:
    """The outcome of one item, addressed to its caller."""

    token: str
    index: int
    outcome: Outcome[Any]
    version: int = WIRE_VERSION  # the reply goes out in the version of the entry
    deadline: float = 0.0  # the caller's, on the server's clock: the reply lives until then


@dataclass(frozen=True)
class DeadLetter:
    """An entry to move to the dead-letter stream, and why."""

    entry_id: bytes
    fields: dict[bytes, bytes] | None
    reason: str
    deliveries: int = 1  # times it was read; `rstreamer dead list` shows it
    level: int = 0


@dataclass
class WorkerStats(BatchStats):
    """Counters a worker publishes in its heartbeat."""

    reclaimed: int = 0
    dead_lettered: int = 0
    cancelled: int = 0  # items their callers withdrew after this worker read them, not run


# Not frozen: one is built per item on the hot path, and a frozen dataclass's __init__ costs
# four times a plain one's (issue 26). Treat it as immutable all the same.
@dataclass(slots=True)
class Parsed:
    """A stream entry as read, and what it decoded to: a Request, or why it is malformed;
    ``level``: the priority level (stream) it was read from; ``delivered``: when (monotonic) this
    worker's XREADGROUP delivered it new, 0 when it is not known to be new (served again,
    reclaimed, or read from levels where a withdrawal may be marked before delivery)."""

    entry_id: bytes
    fields: dict[bytes, bytes] | None
    request: Request | None = None
    error: MalformedEntry | None = None
    level: int = 0
    delivered: float = 0.0

    @property
    def entry(self) -> Entry:
        """The stream entry as it was read: (id, fields)."""
        return self.entry_id, self.fields

    @property
    def ref(self) -> tuple[int, bytes]:
        """The entry's identity: (level, id); ids are unique per level's stream only."""
        return self.level, self.entry_id
