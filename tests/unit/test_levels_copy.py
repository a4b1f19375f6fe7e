"""A streamer's copy of the published levels (rstreamer.wire.published.LevelsCopy): what its
ENQUEUEs send instead of reading the key, while it is fresh."""
from __future__ import annotations

from rstreamer.wire.published import LEVELS_COPY_FRESH, LevelsCopy


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_no_copy_until_a_read_then_the_key_s_value_while_fresh():
    clock = Clock()
    copy = LevelsCopy(clock)
    assert copy.fresh() is None  # never read: the script reads the key
    copy.update(b'{"weights": [8, 1]}')
    assert copy.fresh() == b'{"weights": [8, 1]}'
    clock.now += LEVELS_COPY_FRESH
    assert copy.fresh() == b'{"weights": [8, 1]}'
    clock.now += 0.01
    assert copy.fresh() is None  # too old: the script reads the key again


def test_a_key_that_does_not_exist_is_copied_as_no_levels():
    copy = LevelsCopy(Clock())
    copy.update(None)
    assert copy.fresh() == b""
