"""Cancellation: a caller that is gone withdraws its items, and no worker spends a model call on them.

A caller withdraws its items when its future is cancelled, its call times out, its asyncio task is
cancelled or its web client disconnects. The CANCEL script (one step, atomic) deletes every
entry of the call that no worker has read yet, so none of them is ever run, and marks in the
token's cancellation set (``keys.cancelled``) the indexes of those a worker already holds. A
worker checks the sets of its batch's tokens just before predict (:func:`cancelled_items`) and
acks the marked items without running them; items marked after predict started run, but when
their token was withdrawn whole (``*``) FINISH drops the replies, and the caller's future drops
any answer that still arrives. Nothing cancelled is ever answered to anybody: replies go to the
caller's own reply key.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

from ..broker.connection import RedisClient
from ..client.core import ScriptArgs
from .keys import Keys, is_reply_token
from .messages import REPLY_GRACE

WITHDRAW_GRACE = 2.0
"""Seconds a streamer's close waits for the withdrawals of calls cancelled before it (a web
process that cancels its calls and shuts down must not leave their items queued)."""


def cancel_args(keys: Keys, token: str, level: int, entries: Sequence[tuple[bytes, int]], ttl_s: float,
                whole: bool) -> ScriptArgs:
    """Arguments of the CANCEL script for ``entries`` (``(entry id, index)``) of one token."""
    ttl_ms = max(1, int((ttl_s + REPLY_GRACE) * 1000))
    return {"keys": [keys.cancelled(token), *keys.level_keys(level)],
            "args": [keys.group, ttl_ms, int(whole), len(entries), *(e for e, _ in entries), *(i for _, i in entries)]}


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
