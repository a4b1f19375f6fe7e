"""Cancellation: a caller that is gone withdraws its items, and no worker spends a model call on them.

A caller withdraws its items when its future is cancelled, its call times out, its asyncio task is
cancelled or its web client disconnects. The CANCEL script (one step, atomic) deletes every
entry of the call that no worker has read yet, so none of them is ever run, and marks in the
token's cancellation set (``keys.cancelled``) the indexes of those a worker already holds. A
worker checks the sets of its batch's tokens just before predict (:func:`cancelled_items`; not
for a batch of a prefix without fair sharing delivered new less than a millisecond before, see
rstreamer.worker.loop.FRESH_DELIVERY) and acks the marked items without running them; items
marked after predict started run, but when
their token was withdrawn whole (``*``) its reply list becomes a tombstone that FINISH cannot
push to (so no batch asks whether anybody withdrew), and the caller's future drops any answer
that still arrives. Nothing cancelled is ever answered to anybody: replies go to the
caller's own reply key.
"""
from __future__ import annotations

from collections.abc import Sequence

from .keys import Keys
from .messages import REPLY_GRACE
from .scripts import ScriptArgs

TOMBSTONE_TTL = 60.0
"""Seconds at least that the reply key of a token withdrawn whole stays a tombstone: the workers'
default reply TTL (``WorkerSettings.reply_ttl``), so that an item a worker finishes long after its
caller gave up is not answered either, and (with that default) a tombstone lives no longer than
the reply it keeps out would have."""


def cancel_args(keys: Keys, token: str, level: int, entries: Sequence[tuple[bytes, int]], ttl_s: float,
                whole: bool) -> ScriptArgs:
    """Arguments of the CANCEL script for ``entries`` (``(entry id, index)``) of one token; ``whole``:
    no other call shares the token, so its reply key may become a tombstone."""
    ttl_ms = max(1, int((ttl_s + REPLY_GRACE) * 1000))
    tombstone_ms = max(ttl_ms, int(TOMBSTONE_TTL * 1000)) if whole else 0
    return {"keys": [keys.cancelled(token), *keys.level_keys(level), keys.reply(token)],
            "args": [keys.group, ttl_ms, tombstone_ms, len(entries), *(e for e, _ in entries),
                     *(i for _, i in entries)]}


