"""Unit tests of the pure heartbeat helpers in rstreamer.worker.liveness (no Redis)."""
from __future__ import annotations

import json

import pytest

from rstreamer.wire.published import live_workers, parse_workers, server_time_ms


def beat(seen_ms, **extra) -> bytes:
    return json.dumps({"seen_ms": seen_ms, **extra}).encode()


def test_parse_workers_decodes_names_and_info():
    raw = {b"host:1:ab": beat(1000, gpu=0), b"host:2:cd": beat(2000.5)}
    assert parse_workers(raw) == {"host:1:ab": {"seen_ms": 1000, "gpu": 0}, "host:2:cd": {"seen_ms": 2000.5}}


@pytest.mark.parametrize(
    "value",
    [
        b"{not json",
        b"",
        b"[1, 2]",
        b"42",
        b"null",
        b'{"gpu": 0}',
        b'{"seen_ms": "1000"}',
        b'{"seen_ms": null}',
        b"\xff\xfe\x00",
    ],
    ids=["truncated", "empty", "list", "number", "null", "no-seen", "str-seen", "null-seen", "binary"],
)
def test_parse_workers_skips_corrupt_entries_and_keeps_the_rest(value):
    raw = {b"good": beat(5), b"bad": value}
    assert parse_workers(raw) == {"good": {"seen_ms": 5}}


def test_parse_workers_skips_a_name_that_is_not_utf8():
    assert parse_workers({b"\xff\xfe": beat(5), b"ok": beat(6)}) == {"ok": {"seen_ms": 6}}


def test_parse_workers_of_an_empty_hash():
    assert parse_workers({}) == {}


@pytest.mark.parametrize(
    "reply, ms",
    [((1700000000, 123456), 1700000000123), ((0, 999), 0), ((5, 1000), 5001), ((2, 999999), 2999)],
)
def test_server_time_ms_converts_the_time_reply(reply, ms):
    assert server_time_ms(reply) == ms


def test_live_workers_are_those_seen_within_dead_after_of_server_time():
    now = server_time_ms((1700000000, 0))
    workers = parse_workers({
        b"fresh": beat(now - 100),
        b"edge": beat(now - 2000),
        b"stale": beat(now - 2001),
        b"ahead": beat(now + 50),
        b"ancient": beat(0),
    })
    assert live_workers(now, workers, dead_after_ms=2000) == {"fresh", "edge", "ahead"}


def test_live_workers_depend_on_server_time_not_on_the_local_clock():
    workers = {"w": {"seen_ms": 10_000}}
    assert live_workers(11_000, workers, 2000) == {"w"}
    assert live_workers(12_500, workers, 2000) == set()


def test_live_workers_of_nobody():
    assert live_workers(1000, {}, 2000) == set()
