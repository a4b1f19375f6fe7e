"""Unit tests of the codec's extension types for standard-library values, of nesting, and of
register_type (no Redis)."""
from __future__ import annotations

import collections
import dataclasses
import datetime
import decimal
import enum
import subprocess
import sys
import uuid
import zoneinfo

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import rstreamer
from rstreamer.codec import core as codec
from rstreamer.codec.core import (
    EXT_BIGINT,
    EXT_COMPLEX,
    EXT_DATE,
    EXT_DATETIME,
    EXT_DECIMAL,
    EXT_FROZENSET,
    EXT_SET,
    EXT_TIME,
    EXT_TIMEDELTA,
    EXT_TUPLE,
    EXT_UUID,
    MAX_NESTING,
    packb,
    register_type,
    unpackb,
)
from rstreamer.errors import ConfigError, DecodeError, EncodeError
from support.values import assert_same, roundtrip

UTC = datetime.timezone.utc
PARIS = zoneinfo.ZoneInfo("Europe/Paris")
NEW_YORK = zoneinfo.ZoneInfo("America/New_York")
EST = datetime.timezone(datetime.timedelta(hours=-5), "EST")



def ext(code: int, data: bytes) -> bytes:
    return msgpack.packb(msgpack.ExtType(code, data))


# --- standard-library values ---------------------------------------------------------------

STANDARD_VALUES = {
    "complex": 1.5 - 2j,
    "complex-special": complex(float("inf"), -0.0),
    "datetime-naive": datetime.datetime(2024, 2, 29, 23, 59, 58, 999_999),
    "datetime-min": datetime.datetime.min,
    "datetime-max": datetime.datetime.max,
    "datetime-utc": datetime.datetime(2024, 1, 2, 3, 4, 5, tzinfo=UTC),
    "datetime-named-offset": datetime.datetime(2024, 1, 2, tzinfo=EST),
    "datetime-odd-offset": datetime.datetime(
        2024, 1, 2, tzinfo=datetime.timezone(datetime.timedelta(hours=5, minutes=45, microseconds=7))),
    "datetime-zoneinfo": datetime.datetime(2024, 7, 1, 12, tzinfo=PARIS),
    "datetime-fold": datetime.datetime(2024, 11, 3, 1, 30, fold=1, tzinfo=NEW_YORK),
    "date": datetime.date(1, 1, 1),
    "time": datetime.time(23, 59, 59, 999_999),
    "time-aware": datetime.time(1, 2, 3, 4, tzinfo=EST),
    "time-fold": datetime.time(1, 30, fold=1),
    "timedelta": datetime.timedelta(days=-3, seconds=5, microseconds=7),
    "timedelta-max": datetime.timedelta.max,
    "timedelta-min": datetime.timedelta.min,
    "decimal": decimal.Decimal("1.50"),
    "decimal-exponent": decimal.Decimal("-1.2345E+999999"),
    "decimal-nan": decimal.Decimal("-sNaN123"),
    "decimal-inf": decimal.Decimal("-Infinity"),
    "uuid": uuid.UUID("12345678-1234-5678-1234-567812345678"),
}


@pytest.mark.parametrize("value", STANDARD_VALUES.values(), ids=STANDARD_VALUES.keys())
def test_standard_values_roundtrip_with_their_type(value):
    assert_same(roundtrip(value), value)
    assert_same(roundtrip([value, {"k": (value,)}]), [value, {"k": (value,)}])


def test_utc_comes_back_as_the_utc_singleton_and_zoneinfo_as_the_cached_zone():
    assert roundtrip(datetime.datetime(2024, 1, 1, tzinfo=UTC)).tzinfo is UTC
    assert roundtrip(datetime.datetime(2024, 1, 1, tzinfo=PARIS)).tzinfo is PARIS


class _FixedTz(datetime.tzinfo):
    """A tzinfo class of neither datetime nor zoneinfo, as pytz and dateutil provide."""

    def utcoffset(self, dt):
        return datetime.timedelta(hours=2)

    def dst(self, dt):
        return datetime.timedelta(0)


class _NoOffsetTz(datetime.tzinfo):
    def utcoffset(self, dt):
        return None


def test_other_tzinfo_classes_travel_as_their_fixed_offset():
    value = datetime.datetime(2024, 1, 1, 12, tzinfo=_FixedTz())
    result = roundtrip(value)
    assert result == value and result.utcoffset() == datetime.timedelta(hours=2)
    assert type(result.tzinfo) is datetime.timezone


def test_tzinfo_without_an_offset_is_refused():
    with pytest.raises(EncodeError, match="no fixed offset"):
        packb(datetime.time(1, tzinfo=_NoOffsetTz()))


class Color(enum.IntEnum):
    RED = 1


class Label(str, enum.Enum):
    CAT = "cat"


Point = collections.namedtuple("Point", "x y")


@pytest.mark.parametrize(
    "value, expected",
    [
        (Color.RED, 1),
        (Label.CAT, "cat"),
        (collections.OrderedDict(b=(1,), a=2), {"b": (1,), "a": 2}),
        (collections.defaultdict(list, {"k": [1]}), {"k": [1]}),
        (collections.Counter("aab"), {"a": 2, "b": 1}),
        (Point(1, (2,)), (1, (2,))),
        (type("BigInt", (int,), {})(2**70), 2**70),
        (type("Floaty", (float,), {})(1.5), 1.5),
        (type("Blob", (bytes,), {})(b"x"), b"x"),
        (type("Items", (list,), {})([1, (2,)]), [1, (2,)]),
        (type("Bag", (set,), {})({1}), {1}),
    ],
    ids=lambda v: type(v).__name__,
)
def test_subclasses_of_plain_types_travel_as_their_base_type(value, expected):
    assert_same(roundtrip(value), expected)


def test_values_nested_up_to_the_limit_roundtrip_and_deeper_ones_are_refused():
    value: object = "leaf"
    for _ in range(MAX_NESTING):
        value = (value, [1])
    assert_same(roundtrip(value), value)
    with pytest.raises(EncodeError, match="nested more than"):
        packb((value,))


def test_self_reference_through_a_tuple_is_refused():
    inner: list = []
    value = (inner,)
    inner.append(value)
    with pytest.raises(EncodeError):
        packb(value)


def _nested_ext(levels: int) -> bytes:
    """``levels`` tuples, each the only item of the one around it, written by hand."""
    payload = msgpack.packb([])
    for _ in range(levels - 1):
        payload = msgpack.packb([msgpack.ExtType(EXT_TUPLE, payload)])
    return msgpack.packb(msgpack.ExtType(EXT_TUPLE, payload))


def test_hand_made_nesting_beyond_the_limit_is_a_decode_error():
    value = unpackb(_nested_ext(MAX_NESTING))
    for _ in range(MAX_NESTING - 1):
        (value,) = value
    assert value == ()
    with pytest.raises(DecodeError, match="nested more than"):
        unpackb(_nested_ext(MAX_NESTING + 1))
    with pytest.raises(DecodeError, match="nested more than"):
        unpackb(_nested_ext(10_000))


def test_deep_nesting_does_not_overflow_a_small_thread_stack():
    # unpackb puts ~40 KiB of parse stack on the C stack per call: nested calls crashed a thread
    # with a 256 KiB stack at six levels. Run in a child, as a crash would take pytest down.
    script = (
        "import threading, msgpack; from rstreamer.codec.core import unpackb, EXT_TUPLE, MAX_NESTING\n"
        "payload = msgpack.packb([])\n"
        "for _ in range(MAX_NESTING - 1): payload = msgpack.packb([msgpack.ExtType(EXT_TUPLE, payload)])\n"
        "data = msgpack.packb(msgpack.ExtType(EXT_TUPLE, payload))\n"
        "threading.stack_size(256 * 1024); out = []\n"
        "t = threading.Thread(target=lambda: out.append(unpackb(data))); t.start(); t.join()\n"
        "assert out, 'no result'\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60)
    assert result.returncode == 0, (result.returncode, result.stderr.decode()[-2000:])


# Hand-made extension payloads that an encoder would never write.
CORRUPT = {
    "tuple-not-array": ext(EXT_TUPLE, msgpack.packb({"a": 1})),
    "tuple-truncated": ext(EXT_TUPLE, msgpack.packb([1, 2])[:-1]),
    "tuple-trailing": ext(EXT_TUPLE, msgpack.packb([1]) + b"\x01"),
    "tuple-empty": ext(EXT_TUPLE, b""),
    "set-unhashable": ext(EXT_SET, msgpack.packb([[1]])),
    "set-of-dict": ext(EXT_SET, msgpack.packb([{}])),
    "frozenset-not-array": ext(EXT_FROZENSET, msgpack.packb(3)),
    "bigint-empty": ext(EXT_BIGINT, b""),
    "complex-short": ext(EXT_COMPLEX, b"\x00" * 15),
    "complex-long": ext(EXT_COMPLEX, b"\x00" * 17),
    "datetime-short": ext(EXT_DATETIME, b"\x07\xe8\x01"),
    "datetime-month-13": ext(EXT_DATETIME, b"\x07\xe8\x0d\x01" + b"\x00" * 8),
    "datetime-fold-2": ext(EXT_DATETIME, b"\x07\xe8\x01\x01" + b"\x00" * 7 + b"\x02"),
    "datetime-tz-kind": ext(EXT_DATETIME, b"\x07\xe8\x01\x01" + b"\x00" * 8 + b"\x09"),
    "datetime-tz-short-offset": ext(EXT_DATETIME, b"\x07\xe8\x01\x01" + b"\x00" * 8 + b"\x01\x00"),
    "datetime-tz-offset-25h": ext(
        EXT_DATETIME, b"\x07\xe8\x01\x01" + b"\x00" * 8 + b"\x01" + (25 * 3600 * 10**6).to_bytes(8, "big")),
    "datetime-tz-unnamed-with-name": ext(EXT_DATETIME, b"\x07\xe8\x01\x01" + b"\x00" * 8 + b"\x01" + bytes(8) + b"x"),
    "datetime-tz-name-not-utf8": ext(EXT_DATETIME, b"\x07\xe8\x01\x01" + b"\x00" * 8 + b"\x02" + bytes(8) + b"\xff"),
    "datetime-zone-path": ext(EXT_DATETIME, b"\x07\xe8\x01\x01" + b"\x00" * 8 + b"\x03../../../etc/passwd"),
    "datetime-zone-absolute": ext(EXT_DATETIME, b"\x07\xe8\x01\x01" + b"\x00" * 8 + b"\x03/etc/passwd"),
    "datetime-zone-unknown": ext(EXT_DATETIME, b"\x07\xe8\x01\x01" + b"\x00" * 8 + b"\x03No/Such_Zone"),
    "datetime-zone-nul": ext(EXT_DATETIME, b"\x07\xe8\x01\x01" + b"\x00" * 8 + b"\x03Europe/\x00Paris"),
    "date-year-0": ext(EXT_DATE, b"\x00\x00\x01\x01"),
    "date-trailing": ext(EXT_DATE, b"\x07\xe8\x01\x01\x00"),
    "time-hour-24": ext(EXT_TIME, b"\x18" + b"\x00" * 7),
    "timedelta-overflow": ext(EXT_TIMEDELTA, (10**9).to_bytes(4, "big") + bytes(8)),
    "timedelta-short": ext(EXT_TIMEDELTA, bytes(11)),
    "decimal-garbage": ext(EXT_DECIMAL, b"1.2.3"),
    "decimal-not-ascii": ext(EXT_DECIMAL, "١".encode()),
    "uuid-short": ext(EXT_UUID, bytes(15)),
}


@pytest.mark.parametrize("data", CORRUPT.values(), ids=CORRUPT.keys())
def test_corrupt_standard_payload_raises_decode_error(data):
    with pytest.raises(DecodeError):
        unpackb(data)
    with pytest.raises(DecodeError):
        unpackb(msgpack.packb([1, {"x": msgpack.unpackb(data)}]))


# --- register_type -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Vector:
    x: float
    y: float


@dataclasses.dataclass
class Box:
    corners: tuple
    tags: set


@pytest.fixture
def registered():
    classes = []

    def register(cls, code, encode, decode):
        register_type(cls, code, encode, decode)
        classes.append(cls)

    yield register
    for cls in classes:
        codec._unregister_type(cls)


def test_registered_class_roundtrips_nested_and_as_a_dict_key(registered):
    registered(Vector, 64, lambda v: [v.x, v.y], lambda xy: Vector(*xy))
    registered(Box, 127, lambda b: {"corners": b.corners, "tags": b.tags}, lambda d: Box(**d))
    value = {Vector(1.0, 2.0): [Box((Vector(0.0, 0.0), Vector(1.0, 1.0)), {"a"})]}
    result = roundtrip(value)
    assert result == value
    [box] = result[Vector(1.0, 2.0)]
    assert type(box.corners) is tuple and type(box.corners[0]) is Vector and type(box.tags) is set


def test_register_type_is_exported():
    assert rstreamer.register_type is register_type
    assert "register_type" in rstreamer.__all__


def test_unregistered_class_error_says_how_to_register():
    with pytest.raises(EncodeError, match=r"register_type\(Vector, code, encode, decode\) with a code in 64\.\.127"):
        packb([Vector(1.0, 2.0)])


def test_a_code_registered_only_on_the_sender_is_refused_by_the_receiver(registered):
    registered(Vector, 70, lambda v: [v.x, v.y], lambda xy: Vector(*xy))
    data = packb(Vector(1.0, 2.0))
    codec._unregister_type(Vector)
    try:
        with pytest.raises(DecodeError, match="unknown extension type 70: register"):
            unpackb(data)
    finally:
        register_type(Vector, 70, lambda v: [v.x, v.y], lambda xy: Vector(*xy))


@pytest.mark.parametrize("code", [-1, 0, 1, 13, 63, 128, 1000, "64", 64.0, True], ids=repr)
def test_codes_outside_the_user_range_are_refused(code):
    with pytest.raises(ConfigError, match="64..127"):
        register_type(Vector, code, list, list)


@pytest.mark.parametrize("cls", [int, str, bytes, list, dict, tuple, set, frozenset, complex, datetime.datetime,
                                 decimal.Decimal, type(None), bool])
def test_types_the_codec_carries_cannot_be_registered(cls):
    with pytest.raises(ConfigError, match="carried by rstreamer already"):
        register_type(cls, 64, list, list)


def test_register_type_needs_a_class():
    with pytest.raises(ConfigError, match="needs a class"):
        register_type(Vector(1.0, 2.0), 64, list, list)


def test_code_and_class_collisions_are_refused(registered):
    registered(Vector, 64, lambda v: [v.x, v.y], lambda xy: Vector(*xy))
    with pytest.raises(ConfigError, match="code 64 is already registered for .*Vector"):
        register_type(Box, 64, list, list)
    with pytest.raises(ConfigError, match="already registered with code 64"):
        register_type(Vector, 65, list, list)


def test_a_subclass_of_a_plain_type_can_be_registered(registered):
    registered(Color, 66, int, Color)
    assert roundtrip([Color.RED]) == [Color.RED]
    assert type(roundtrip(Color.RED)) is Color


def test_failing_encoder_raises_encode_error_and_failing_decoder_decode_error(registered):
    def bad_encode(value):
        raise RuntimeError("no")

    registered(Vector, 64, bad_encode, lambda xy: Vector(*xy))
    with pytest.raises(EncodeError, match="encoder registered for .*Vector failed"):
        packb(Vector(1.0, 2.0))
    registered(Box, 65, lambda b: [b.corners, b.tags], lambda state: Box(*state))
    data = msgpack.packb(msgpack.ExtType(65, msgpack.packb([1, 2, 3])))  # three fields for two
    with pytest.raises(DecodeError, match="type 65"):
        unpackb(data)


def test_registered_values_count_against_the_nesting_limit(registered):
    registered(Box, 64, lambda b: [b.corners], lambda state: Box(state[0], set()))
    value: object = "leaf"
    for _ in range(MAX_NESTING + 1):
        value = Box(value, set())  # one level more than allowed
    with pytest.raises(EncodeError, match="nested more than"):
        packb(value)


# --- properties (hypothesis) ---------------------------------------------------------------

_FAST = settings(max_examples=80, deadline=None, database=None)

_timezones = st.none() | st.timezones() | st.builds(
    datetime.timezone,
    st.timedeltas(min_value=datetime.timedelta(hours=-23), max_value=datetime.timedelta(hours=23)),
)
_hashable = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
    | st.binary(max_size=8)
    | st.complex_numbers(allow_nan=False)
    | st.decimals(allow_nan=False)  # NaN != NaN; the NaNs have their own test above
    | st.uuids()
    | st.dates()
    | st.timedeltas()
    | st.datetimes(timezones=_timezones, allow_imaginary=False)
    | st.times(timezones=st.none() | st.just(UTC)),
    lambda children: st.tuples(children, children) | st.frozensets(children, max_size=4),
    max_leaves=8,
)
_values = st.recursive(
    _hashable,
    lambda children: st.lists(children, max_size=4)
    | st.tuples(children)
    | st.sets(_hashable, max_size=4)
    | st.dictionaries(_hashable, children, max_size=4),
    max_leaves=16,
)

@_FAST
@given(_values)
def test_property_values_roundtrip_with_their_types(value):
    assert_same(roundtrip(value), value)

@_FAST
@given(st.binary(max_size=300), st.sampled_from(sorted(codec._LEAF_DECODERS) + sorted(codec._NESTED_DECODERS)))
def test_property_arbitrary_extension_payloads_decode_or_raise_decode_error(payload, code):
    try:
        unpackb(ext(code, payload))
    except DecodeError:
        pass
