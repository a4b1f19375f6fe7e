"""Payloads of the standard-library values that msgpack lacks: big int, complex, the datetime
family, Decimal and UUID.

Each encoder turns one value into the bytes of an extension payload; each decoder checks those
bytes and rebuilds the value, raising DecodeError (or a ValueError or TypeError that the codec
turns into one) on anything an encoder would not have written. No decoder runs user code or
unpickles: a time zone travels as a fixed offset (with its name, if it was given one) or as a
zoneinfo key, which ``ZoneInfo`` refuses when it names a path outside the time zone database.
"""
from __future__ import annotations

import datetime
import decimal
import struct
import sys
from typing import Any

from ..errors import DecodeError, EncodeError

_COMPLEX = struct.Struct(">dd")


def encode_bigint(value: int) -> bytes:
    """Two's complement, big-endian, in as few bytes as hold the sign."""
    return value.to_bytes(value.bit_length() // 8 + 1, "big", signed=True)


def decode_bigint(data: bytes) -> int:
    """The int that :func:`encode_bigint` wrote."""
    if not data:
        raise DecodeError("empty big integer")
    return int.from_bytes(data, "big", signed=True)


def encode_complex(value: complex) -> bytes:
    """A complex number as two big-endian doubles."""
    return _COMPLEX.pack(value.real, value.imag)


def decode_complex(data: bytes) -> complex:
    """The complex number that :func:`encode_complex` wrote."""
    if len(data) != _COMPLEX.size:
        raise DecodeError(f"complex number of {len(data)} bytes, expected {_COMPLEX.size}")
    return complex(*_COMPLEX.unpack(data))


def encode_decimal(value: decimal.Decimal) -> bytes:
    """A Decimal as its exact string form."""
    return str(value).encode("ascii")


def decode_decimal(data: bytes) -> decimal.Decimal:
    """The Decimal that :func:`encode_decimal` wrote."""
    return decimal.Decimal(data.decode("ascii"))


def encode_uuid(value: Any) -> bytes:
    """A UUID as its 16 bytes."""
    return bytes(value.bytes)


def decode_uuid(data: bytes) -> Any:
    """The UUID that :func:`encode_uuid` wrote."""
    import uuid  # imported only when a UUID is met: it is slow to import

    if len(data) != 16:
        raise DecodeError(f"UUID of {len(data)} bytes, expected 16")
    return uuid.UUID(bytes=bytes(data))


def _micros(delta: datetime.timedelta) -> int:
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


# A time zone follows the date and time fields: nothing (naive), or one byte of kind and its data.
_TZ_OFFSET, _TZ_NAMED_OFFSET, _TZ_KEY = 1, 2, 3
_OFFSET = struct.Struct(">q")  # microseconds east of UTC
_DATETIME = struct.Struct(">HBBBBBIB")  # year, month, day, hour, minute, second, microsecond, fold
_DATE = struct.Struct(">HBB")
_TIME = struct.Struct(">BBBIB")  # hour, minute, second, microsecond, fold
_TIMEDELTA = struct.Struct(">iII")  # days, seconds, microseconds (as timedelta normalises them)


def _encode_tz(tz: datetime.tzinfo | None, value: datetime.datetime | datetime.time) -> bytes:
    if tz is None:
        return b""
    if type(tz) is datetime.timezone:
        offset, *name = tz.__getinitargs__()  # type: ignore[attr-defined]
        kind = _TZ_NAMED_OFFSET if name else _TZ_OFFSET
        return bytes([kind]) + _OFFSET.pack(_micros(offset)) + "".join(name).encode("utf-8")
    zoneinfo = sys.modules.get("zoneinfo")  # a ZoneInfo exists only once zoneinfo is imported
    if zoneinfo is not None and isinstance(tz, zoneinfo.ZoneInfo) and tz.key is not None:
        key: str = tz.key  # zoneinfo came from sys.modules, untyped
        return bytes([_TZ_KEY]) + key.encode("utf-8")
    # another tzinfo class (pytz, dateutil): its rules cannot travel, its offset at this instant can
    offset = value.utcoffset()
    if offset is None:
        raise EncodeError(f"time zone {tz!r:.80} has no fixed offset; use datetime.timezone or zoneinfo")
    return bytes([_TZ_OFFSET]) + _OFFSET.pack(_micros(offset))


def _decode_tz(data: bytes) -> datetime.tzinfo | None:
    if not data:
        return None
    kind, rest = data[0], bytes(data[1:])
    if kind == _TZ_KEY:
        import zoneinfo

        return zoneinfo.ZoneInfo(rest.decode("utf-8"))  # refuses absolute paths and keys outside TZPATH
    if kind not in (_TZ_OFFSET, _TZ_NAMED_OFFSET) or len(rest) < _OFFSET.size:
        raise DecodeError("invalid time zone")
    offset = datetime.timedelta(microseconds=_OFFSET.unpack_from(rest)[0])
    name = rest[_OFFSET.size :].decode("utf-8")
    if kind == _TZ_OFFSET and name:
        raise DecodeError("invalid time zone")
    return datetime.timezone(offset, name) if kind == _TZ_NAMED_OFFSET else datetime.timezone(offset)


def _split(data: bytes, layout: struct.Struct, what: str) -> tuple[tuple[int, ...], bytes]:
    """The fixed fields and the time zone bytes after them."""
    if len(data) < layout.size:
        raise DecodeError(f"{what} of {len(data)} bytes, expected at least {layout.size}")
    return layout.unpack_from(data), data[layout.size :]


def encode_datetime(value: datetime.datetime) -> bytes:
    """A datetime as its fields, with its UTC offset when it is aware."""
    fields = _DATETIME.pack(
        value.year,
        value.month,
        value.day,
        value.hour,
        value.minute,
        value.second,
        value.microsecond,
        value.fold,
    )
    return fields + _encode_tz(value.tzinfo, value)


def decode_datetime(data: bytes) -> datetime.datetime:
    """The datetime that :func:`encode_datetime` wrote."""
    (year, month, day, hour, minute, second, micros, fold), tz = _split(data, _DATETIME, "datetime")
    return datetime.datetime(year, month, day, hour, minute, second, micros, tzinfo=_decode_tz(tz), fold=fold)


def encode_date(value: datetime.date) -> bytes:
    """A date as year, month and day."""
    return _DATE.pack(value.year, value.month, value.day)


def decode_date(data: bytes) -> datetime.date:
    """The date that :func:`encode_date` wrote."""
    parts, rest = _split(data, _DATE, "date")
    if rest:
        raise DecodeError("date has trailing bytes")
    return datetime.date(*parts)


def encode_time(value: datetime.time) -> bytes:
    """A time of day as its fields, with its UTC offset when it is aware."""
    fields = _TIME.pack(value.hour, value.minute, value.second, value.microsecond, value.fold)
    return fields + _encode_tz(value.tzinfo, value)


def decode_time(data: bytes) -> datetime.time:
    """The time that :func:`encode_time` wrote."""
    (hour, minute, second, micros, fold), tz = _split(data, _TIME, "time")
    return datetime.time(hour, minute, second, micros, tzinfo=_decode_tz(tz), fold=fold)


def encode_timedelta(value: datetime.timedelta) -> bytes:
    """A timedelta as days, seconds and microseconds."""
    return _TIMEDELTA.pack(value.days, value.seconds, value.microseconds)


def decode_timedelta(data: bytes) -> datetime.timedelta:
    """The timedelta that :func:`encode_timedelta` wrote."""
    (days, seconds, microseconds), rest = _split(data, _TIMEDELTA, "timedelta")
    if rest:
        raise DecodeError("timedelta has trailing bytes")
    return datetime.timedelta(days=days, seconds=seconds, microseconds=microseconds)
