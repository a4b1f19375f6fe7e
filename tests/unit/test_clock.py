"""Unit tests of rstreamer.broker.clock.ServerClock (no Redis)."""
from __future__ import annotations

import pytest

from rstreamer.broker.clock import ServerClock


def test_reads_the_wall_clock_until_it_has_seen_the_server():
    clock = ServerClock(monotonic=lambda: 5.0, wall=lambda: 1000.0)
    assert clock.now() == 1000.0 and clock.wall_to_server() == 0.0


def test_follows_the_server_from_the_midpoint_of_the_round_trip_whatever_the_host_wall_clock():
    ticks = {"mono": 10.0}
    clock = ServerClock(monotonic=lambda: ticks["mono"], wall=lambda: 25.0 + ticks["mono"])  # wall 25 s ahead
    clock.observe(server_ms=2_000_000, sent=9.0, received=11.0)
    assert clock.now() == pytest.approx(2000.0)
    ticks["mono"] = 13.5
    assert clock.now() == pytest.approx(2003.5)
    assert clock.wall_to_server() == pytest.approx(2003.5 - 38.5)
