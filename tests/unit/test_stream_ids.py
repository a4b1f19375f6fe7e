"""The order of stream entry ids the worker gives FINISH (rstreamer.wire.stream_ids)."""
from __future__ import annotations

import random

import pytest

from rstreamer.wire.stream_ids import id_order, newest_last

OLDER_NEWER = [(b"999999999999-7", b"1000000000000-9"), (b"1000000000000-9", b"1000000000000-10"),
               (b"1000000000000-12", b"1000000000001-0"), (b"1000000000000-99", b"1000000000001-10"),
               (b"1000000000009-5", b"1000000000010-5"), (b"1-0", b"1-1")]
"""Pairs of ids, older first, where their strings sort otherwise or a part's length misleads."""


@pytest.mark.parametrize(("older", "newer"), OLDER_NEWER)
def test_ids_are_ordered_as_redis_orders_them(older, newer):
    assert id_order(older) < id_order(newer)
    assert newest_last([newer, older]) == [older, newer]
    assert newest_last([older, newer]) == [older, newer]


def test_the_newest_goes_last_and_the_others_keep_their_order():
    ids = [b"1764000000005-3", b"1764000000010-0", b"1764000000005-12", b"1764000000001-0"]
    assert newest_last(ids) == [b"1764000000005-3", b"1764000000005-12", b"1764000000001-0", b"1764000000010-0"]
    assert ids[1] == b"1764000000010-0", "the caller's list is left as it was"


def test_any_order_of_many_ids_ends_with_their_newest():
    ids = [f"{ms}-{seq}".encode() for ms in (999, 1000, 1001) for seq in (0, 9, 10, 99, 100)]
    for seed in range(20):
        shuffled = random.Random(seed).sample(ids, len(ids))
        ordered = newest_last(shuffled)
        assert ordered[-1] == b"1001-100"
        assert sorted(ordered) == sorted(ids)


@pytest.mark.parametrize("ids", [[], [b"1-1"]])
def test_no_id_or_one_is_its_own_order(ids):
    assert newest_last(ids) == ids
