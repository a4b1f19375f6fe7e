"""Where a worker's entries come from: its stream of one level (:class:`StreamSource`), parsed into
items (:class:`ParsedSource`), and the withdrawals it checks before predict (:func:`cancelled_items`).
The sources of several levels are in :mod:`rstreamer.worker.levelsource`.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any, cast

import redis
from redis.typing import KeyT, StreamIdT

from ..broker.connection import RedisClient, is_nogroup
from ..wire.groups import ensure_group
from ..wire.keys import Keys, is_reply_token
from ..wire.scripts import scripts
from .carry import Carried, Carrier, ReadAhead
from .levelsource import LevelSource, SingleLevel
from .records import Entry, Parsed, field_dict, read_new, stream_entries


class StreamSource(Carrier):
    """The ItemSource of a worker: XREADGROUP on the prefix's request stream, with the last
    batch's FINISH in the same round trip (:class:`~rstreamer.worker.carry.Carrier`).

    After a failed reply (see :meth:`rewind`), the entries this consumer read but could not
    ack are served again first, each once, in id order, from a cursor; only then new ones.
    """

    def __init__(self, client: RedisClient, keys: Keys, consumer: str, reads: RedisClient | None = None) -> None:
        super().__init__(reads or client)  # XREADGROUP '>' (see WorkerContext.reads)
        self._client = client
        self._keys = keys
        self._consumer = consumer
        self._own_pending = scripts(client).read_own_pending
        # The last own pending entry served, "-" for none yet; None: serve new entries.
        self._cursor: str | None = "-"
        self.fresh = False
        """Whether the last fetch's entries were delivered new (XREADGROUP '>'), not served again."""
        self._ahead = ReadAhead()

    def rewind(self) -> None:
        """Serve this consumer's own unacked entries again, before new ones; a carried call not
        sent yet is dropped (its entries are among them: served again, as after a failed FINISH)."""
        self._cursor = "-"
        self.drop()

    def fetch(self, max_items: int, timeout: float) -> list[Entry]:
        """Up to ``max_items`` entries: this consumer's own backlog first, then new ones (blocking ``timeout`` s)."""
        self.fresh = False
        if self._cursor is not None:
            self.settle()
            self.flush()  # else the entries it answers would be among those served again
            backlog = self._read_own_pending(self._cursor, max_items)
            if backlog:
                return backlog
            self._cursor = None
        # BLOCK 0 means forever, so a wait is never shorter than 1 ms; no BLOCK: no wait.
        block = max(1, int(timeout * 1000)) if timeout > 0 else None
        carried = self.take()
        fresh = True
        try:
            if carried is None:
                streams: dict[KeyT, StreamIdT] = {self._keys.requests: ">"}
                reply = cast("list[tuple[bytes, list[Entry]]] | None", self._reads.xreadgroup(
                    self._keys.group, self._consumer, streams, count=max_items, block=block))
                entries = [(entry_id, fields) for _, stream_entries in (reply or [])
                           for entry_id, fields in stream_entries]
            elif carried.ahead and self._ahead.due():
                entries, fresh = self._read_ahead(carried, max_items, block)
            else:
                entries, fresh = self._read_carrying(carried, max_items, block)
        except redis.ResponseError as exc:
            if not is_nogroup(exc):
                raise
            ensure_group(self._client, self._keys)
            return []
        self.fresh = fresh
        return entries

    def _read_carrying(self, carried: Carried, max_items: int, block: int | None) -> tuple[list[Entry], bool]:
        """The carried call, then XREADGROUP, sent together: the entries read, and whether they are
        fresh (see :meth:`Carrier.send_with`). Raises the call's error or the read's."""
        (reply,), fresh = self.send_with(carried, [self._xreadgroup(max_items, block)])
        if isinstance(reply, Exception):
            raise reply
        return stream_entries(reply), fresh

    def _read_ahead(self, carried: Carried, max_items: int, block: int | None) -> tuple[list[Entry], bool]:
        """After a full batch: XREADGROUP without waiting, then the carried call sent behind it, to
        run while the entries read do (:meth:`Carrier.send_ahead`); when nothing waits after all,
        the carried call and a waiting XREADGROUP together, as :meth:`_read_carrying`, and the
        next few full batches do that at once (:class:`~rstreamer.worker.carry.ReadAhead`)."""
        (reply,) = self.exchange([self._xreadgroup(max_items, None)])
        if isinstance(reply, Exception):
            self.carry(carried)  # not sent: the caller's error path serves its entries again
            raise reply
        entries = stream_entries(reply)
        self._ahead.found(bool(entries))
        if not entries:
            return self._read_carrying(carried, max_items, block)
        self.send_ahead(carried)
        return entries, True

    def _xreadgroup(self, max_items: int, block: int | None) -> list[Any]:
        return read_new(self._keys.group, self._consumer, max_items, [self._keys.requests], block)

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
