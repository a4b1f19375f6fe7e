"""Values keep their type over Redis, as they do in the local streamers (service-streamer's
pickle kept them): real redis-server, real worker process."""
from __future__ import annotations

import datetime
import decimal
import uuid
import zoneinfo

from rstreamer import RedisStreamer, ThreadedStreamer
from support.typed import Span, identity

VALUES = [
    [("n0", "tabby")],
    (1, (2.5, "a")),
    {3, 1, 2},
    frozenset({"x", (1, 2)}),
    {(1, 2): "tuple key", frozenset({3}): [Span(0, 4)]},
    2**70,
    -(10**30),
    1 - 2j,
    datetime.datetime(2024, 11, 3, 1, 30, fold=1, tzinfo=zoneinfo.ZoneInfo("America/New_York")),
    datetime.datetime(2024, 1, 2, 3, 4, 5, 6, tzinfo=datetime.timezone.utc),
    datetime.date(2024, 2, 29),
    datetime.time(12, 30, tzinfo=datetime.timezone(datetime.timedelta(hours=-5), "EST")),
    datetime.timedelta(days=-1, microseconds=3),
    decimal.Decimal("1.50"),
    uuid.UUID("12345678-1234-5678-1234-567812345678"),
    Span(3, 7),
]


def shape(value):
    """The value with the type of every part, so that == also compares types."""
    if isinstance(value, (list, tuple)):
        return type(value), [shape(v) for v in value]
    if isinstance(value, dict):
        return dict, [(shape(k), shape(v)) for k, v in value.items()]
    if isinstance(value, (set, frozenset)):
        return type(value), sorted(repr(shape(v)) for v in value)
    tz = getattr(value, "tzinfo", None)
    return type(value), str(value), type(tz), getattr(value, "fold", None)


def test_redis_transport_returns_what_the_local_streamer_returns(redis_url, prefix, workers):
    workers.start(prefix, model="support.typed:Identity")
    with ThreadedStreamer(identity, batch_size=8) as local:
        expected = local.predict(VALUES)
    with RedisStreamer(redis_url, prefix) as streamer:
        outputs = streamer.predict(VALUES)
    assert [shape(v) for v in outputs] == [shape(v) for v in expected] == [shape(v) for v in VALUES]
    assert outputs == VALUES
