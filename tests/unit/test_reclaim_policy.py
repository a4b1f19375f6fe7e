"""Unit tests of the pure delivery-count policy in rstreamer.worker.reclaim (no Redis)."""
from __future__ import annotations

import pytest

from rstreamer.worker.reclaim import PendingEntry, ReclaimPlan, plan_reclaim


def pending(*deliveries: int) -> list[PendingEntry]:
    return [PendingEntry(f"{n}-0".encode(), count) for n, count in enumerate(deliveries)]


def test_plan_reclaim_sorts_by_delivery_count_keeping_stream_order():
    entries = pending(1, 2, 3, 1, 5, 2, 4)
    plan = plan_reclaim(entries, max_deliveries=3)
    assert plan.batch == [b"0-0", b"3-0"]
    assert plan.single == [b"1-0", b"5-0"]
    assert plan.dead == [entries[2], entries[4], entries[6]]


def test_dead_entries_keep_their_delivery_counts():
    plan = plan_reclaim(pending(3, 7), max_deliveries=3)
    assert [(entry.entry_id, entry.deliveries) for entry in plan.dead] == [(b"0-0", 3), (b"1-0", 7)]


@pytest.mark.parametrize(
    "deliveries, max_deliveries, where",
    [
        (1, 3, "batch"),
        (2, 3, "single"),
        (3, 3, "dead"),
        (4, 3, "dead"),
        (1, 2, "batch"),
        (2, 2, "dead"),
        (1, 1, "dead"),
        (0, 3, "batch"),
        (9, 10, "single"),
        (10, 10, "dead"),
    ],
)
def test_plan_reclaim_boundaries(deliveries, max_deliveries, where):
    plan = plan_reclaim(pending(deliveries), max_deliveries)
    placed = {"batch": plan.batch, "single": plan.single, "dead": [entry.entry_id for entry in plan.dead]}
    assert placed[where] == [b"0-0"]
    assert sum(len(ids) for ids in placed.values()) == 1


def test_no_entry_is_ever_run_beyond_max_deliveries():
    for max_deliveries in range(1, 6):
        plan = plan_reclaim(pending(*range(1, 10)), max_deliveries)
        runnable = set(plan.batch + plan.single)
        counts = {entry.entry_id: entry.deliveries for entry in pending(*range(1, 10))}
        assert all(counts[entry_id] + 1 <= max_deliveries for entry_id in runnable)


def test_plan_reclaim_of_nothing_is_empty():
    assert plan_reclaim([], 3) == ReclaimPlan([], [], [])
