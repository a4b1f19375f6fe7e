"""Where a worker's entries come from: its stream of one level (:class:`StreamSource`), parsed into
items (:class:`ParsedSource`), and the withdrawals it checks before predict (:func:`cancelled_items`).
The sources of several levels are in :mod:`rstreamer.worker.levelsource`.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, cast

import redis
from redis.typing import KeyT, StreamIdT

from ..broker.connection import RedisClient, is_nogroup
from ..wire.groups import ensure_group
from ..wire.keys import Keys, is_reply_token
from ..wire.scripts import scripts
from .levelsource import LevelSource, SingleLevel
from .records import Entry, Parsed, field_dict


@dataclass
class Carried:
    """A script call a worker sends in the round trip of its next read (see :meth:`StreamSource.carry`)."""

    script: Any  # redis-py's Script
    keys: list[str]
    args: list[Any]

    def run(self) -> None:
        """Run it on its own (EVALSHA, the script loaded again if Redis lost it)."""
        self.script(keys=self.keys, args=self.args)


class StreamSource:
    """The ItemSource of a worker: XREADGROUP on the prefix's request stream.

    After a failed reply (see :meth:`rewind`), the entries this consumer read but could not
    ack are served again first, each once, in id order, from a cursor; only then new ones.
    """

    def __init__(self, client: RedisClient, keys: Keys, consumer: str, reads: RedisClient | None = None) -> None:
        self._client = client
        self._reads = reads or client  # XREADGROUP '>' (see WorkerContext.reads)
        self._keys = keys
        self._consumer = consumer
        self._own_pending = scripts(client).read_own_pending
        # The last own pending entry served, "-" for none yet; None: serve new entries.
        self._cursor: str | None = "-"
        self._carried: Carried | None = None
        self._pipeline: redis.client.Pipeline | None = None  # reused: only the worker's loop reads
        self.fresh = False
        """Whether the last fetch's entries were delivered new (XREADGROUP '>'), not served again."""

    def rewind(self) -> None:
        """Serve this consumer's own unacked entries again, before new ones; a carried call not
        sent yet is dropped (its entries are among them: served again, as after a failed FINISH)."""
        self._cursor = "-"
        self._carried = None

    def carry(self, call: Carried) -> None:
        """Send ``call`` (the FINISH of the batch a worker just ran) in the same round trip as the
        next read: one round trip per batch instead of two, which cost the worker and Redis
        more CPU than anything else they do per batch (issue 26). The caller's answer is not
        delayed: the read follows the batch at once. One at a time: a second runs the first now.
        The worker flushes it before it runs a batch that no read of new entries brought (a
        model that kills its process must not take the answers of the batch before with it)."""
        self.flush()
        self._carried = call

    def flush(self) -> None:
        """Run the carried call now, if there is one (before any other command of the worker's
        loop, and before it stops)."""
        carried, self._carried = self._carried, None
        if carried is not None:
            carried.run()

    def fetch(self, max_items: int, timeout: float) -> list[Entry]:
        """Up to ``max_items`` entries: this consumer's own backlog first, then new ones (blocking ``timeout`` s)."""
        self.fresh = False
        if self._cursor is not None:
            self.flush()  # else the entries it answers would be among those served again
            backlog = self._read_own_pending(self._cursor, max_items)
            if backlog:
                return backlog
            self._cursor = None
        # BLOCK 0 means forever, so a wait is never shorter than 1 ms; no BLOCK: no wait.
        block = max(1, int(timeout * 1000)) if timeout > 0 else None
        streams: dict[KeyT, StreamIdT] = {self._keys.requests: ">"}
        carried, self._carried = self._carried, None
        fresh = True
        try:
            if carried is None:
                reply = self._reads.xreadgroup(self._keys.group, self._consumer, streams, count=max_items, block=block)
            else:
                reply, fresh = self._read_carrying(carried, streams, max_items, block)
        except redis.ResponseError as exc:
            if not is_nogroup(exc):
                raise
            ensure_group(self._client, self._keys)
            return []
        self.fresh = fresh
        read = cast("list[tuple[bytes, list[Entry]]] | None", reply)  # our client does not decode replies
        return [(entry_id, fields) for _, stream_entries in (read or []) for entry_id, fields in stream_entries]

    def _read_carrying(self, carried: Carried, streams: dict[KeyT, StreamIdT], max_items: int,
                       block: int | None) -> tuple[Any, bool]:
        """The carried call, then XREADGROUP, in one pipeline: the read's reply, and whether its
        entries are fresh (not when the call had to run again after the read). Raises the call's
        error (its entries and those just read are then served again, see rewind) or the read's."""
        if self._pipeline is None:
            self._pipeline = cast("redis.client.Pipeline", self._reads.pipeline(transaction=False))
        pipe = self._pipeline  # empty again after each execute()
        # EVALSHA itself: a Script in a pipeline asks SCRIPT EXISTS first, one more round trip.
        pipe.evalsha(carried.script.sha, len(carried.keys), *carried.keys, *carried.args)
        pipe.xreadgroup(self._keys.group, self._consumer, streams, count=max_items, block=block)
        finished, reply = pipe.execute(raise_on_error=False)
        fresh = True
        if isinstance(finished, redis.exceptions.NoScriptError):
            # Redis lost its scripts (a restart, SCRIPT FLUSH): loaded and run again. That takes
            # time after the read delivered its entries: they are not fresh (Parsed.delivered).
            carried.run()
            fresh = False
        elif isinstance(finished, Exception):
            raise finished
        if isinstance(reply, Exception):
            raise reply
        return reply, fresh

    def _read_own_pending(self, cursor: str, max_items: int) -> list[Entry]:
        # Not XREADGROUP from an id: that would count as one more delivery toward max_deliveries.
        try:
            rows: list[tuple[bytes, list[bytes] | None]] = self._own_pending(
                keys=[self._keys.requests], args=[self._keys.group, self._consumer, cursor, max_items])
        except redis.ResponseError as exc:
            if not is_nogroup(exc):
                raise
            return []  # the stream is gone, and our pending entries with it
        entries = [(entry_id, field_dict(flat)) for entry_id, flat in rows]
        if entries:
            self._cursor = entries[-1][0].decode()
        return entries


class ParsedSource:
    """The worker's ItemSource: entries decoded as they are read, so that a cost-aware batch
    knows each item's cost (``ManagedModel.cost`` takes the decoded input)."""

    def __init__(self, source: SingleLevel | LevelSource, parse: Callable[[Entry, int, float], Parsed]) -> None:
        self._source = source
        self._parse = parse

    def fetch(self, max_items: int, timeout: float) -> list[Parsed]:
        """The next entries of the streams, each decoded with the level it was read from and, when
        they were delivered new, the time they were (see Parsed.delivered)."""
        entries = self._source.fetch(max_items, timeout)
        delivered = time.monotonic() if self._source.fresh else 0.0
        return [self._parse(entry, level, delivered) for level, entry in entries]


def cancelled_items(client: RedisClient, keys: Keys, items: Iterable[tuple[str, int]]) -> set[tuple[str, int]]:
    """The ``(token, index)`` among ``items`` whose callers withdrew them.

    One EXISTS over the batch's cancellation sets, which is all it costs when nobody cancelled
    (the usual case); the sets that exist are then read in one pipeline.
    """
    # Job items are withdrawn by cancelling their job (rstreamer.jobs.sync), not one by one.
    tokens = sorted({token for token, _ in items if is_reply_token(token)})
    if not tokens:
        return set()
    names = [keys.cancelled(token) for token in tokens]
    if not client.exists(*names):
        return set()
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.smembers(name)
    marked = {token: {m.decode() for m in members} for token, members in zip(tokens, pipe.execute(), strict=True)}
    return {(token, index) for token, index in items
            if marked.get(token) and ("*" in marked[token] or str(index) in marked[token])}
