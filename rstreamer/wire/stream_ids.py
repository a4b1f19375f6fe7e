"""The order of stream entry ids, for FINISH: each stream's ids go to it with the newest last.

FINISH (wire/lua/finish.lua) acks a batch's entries and takes them off their stream by trimming
it up to the last id of the stream's list, when nothing older is pending. Finding the newest of
a batch's ids in the script cost Redis a pattern match and a comparison per id, a quarter of
FINISH's instructions (callgrind, Redis 7.0, issue 26); here it is a sort key per id in the
worker, which scales with the workers where Redis does not.
"""
from __future__ import annotations

from collections.abc import Sequence


def id_order(entry_id: bytes) -> tuple[int, bytes, int, bytes]:
    """A sort key of an id ``ms-seq`` as Redis writes it (plain digits, no leading zero) that
    orders ids as Redis does: the ms part first (a longer one is greater), then the sequence."""
    ms, _, seq = entry_id.partition(b"-")
    return len(ms), ms, len(seq), seq


def newest_last(ids: Sequence[bytes]) -> list[bytes]:
    """``ids`` with the newest of them moved to the end, the others in their order.

    FINISH trims a stream only up to the last id of its list: a last id that is not the newest
    would leave the newer acked entries in the stream (counted as waiting) until a later FINISH
    trims past them, never take away an entry that waits.
    """
    ordered = list(ids)
    if len(ordered) > 1:
        newest = max(ordered, key=id_order)
        if ordered[-1] != newest:
            ordered.remove(newest)
            ordered.append(newest)
    return ordered
