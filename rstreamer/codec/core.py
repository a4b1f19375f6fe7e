"""msgpack encoding of everything that crosses the broker; never pickle.

None, bool, int, float, str, bytes, list and dict are msgpack's own and take its C fast path.
Every other value travels as an extension type, so that it comes back as the type it was sent:
numpy arrays and torch tensors (codec_arrays); tuple, set and frozenset (their items packed
inside); big ints, complex, the datetime family, Decimal and UUID (codec_std); and the classes an
application registers with :func:`register_type`. Subclasses of the plain types (IntEnum,
OrderedDict, namedtuple) travel as their base type. Anything else is refused with EncodeError.

Decoding is bounded in bytes (``max_bytes``) and in objects (``max_objects``): one byte of
msgpack can be an empty list, which costs about 80 bytes of memory once decoded.
"""
from __future__ import annotations

import datetime
import decimal
import functools
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import msgpack

from ..errors import ConfigError, DecodeError, EncodeError
from . import arrays as codec_arrays
from . import std as codec_std

T = TypeVar("T")

# Extension codes are part of the wire format: never renumber one.
EXT_NDARRAY = 1
EXT_TENSOR = 2
EXT_TUPLE = 3
EXT_SET = 4
EXT_FROZENSET = 5
EXT_BIGINT = 6
EXT_COMPLEX = 7
EXT_DATETIME = 8
EXT_DATE = 9
EXT_TIME = 10
EXT_TIMEDELTA = 11
EXT_DECIMAL = 12
EXT_UUID = 13
USER_CODES = range(64, 128)  # 0..63 are rstreamer's own; msgpack reserves the negative codes

DEFAULT_MAX_BYTES = 64 * 1024 * 1024
# The default object budget is max_bytes / 8, so that a list of floats (9 bytes each) always fits.
BYTES_PER_OBJECT = 8
MIN_MAX_OBJECTS = 1024
MAX_NESTING = 32  # tuples, sets and registered values inside one another
_C_STACK_NESTING = 1  # nesting levels decoded with unpackb (see _unpack_nested)

_PACK_OPTIONS: dict[str, Any] = {"use_bin_type": True, "datetime": False, "strict_types": True}
_PACKER_BUFFER = 16 * 1024  # msgpack starts each Packer at 256 KiB; pooled ones grow as needed
_UNPACK_OPTIONS: dict[str, Any] = {"raw": False, "strict_map_key": False}
_NATIVE_TYPES = frozenset({type(None), bool, int, float, str, bytes, bytearray, memoryview, list, dict})
_MISSING = object()

_Encoder = Callable[[Any, int], bytes]  # (value, nesting depth) -> extension payload
_ENCODERS: dict[type, tuple[int, _Encoder]] = {}  # by exact type
# numpy's ndarray and torch's Tensor once met (see _encode_lazy), by exact type: the ext is then
# made without asking who they are again (a 768-float vector, which a worker encodes per item of
# an embedding model: 4.96 -> 1.92 us on a 2-vCPU VM, of which 0.3 us copy its bytes; issue 26).
_ARRAY_ENCODERS: dict[type, tuple[int, _Encoder]] = {}
_LEAF_DECODERS: dict[int, Callable[[bytes], Any]] = {}  # payload -> value
_NESTED_DECODERS: dict[int, Callable[[Any], Any]] = {}  # unpacked payload -> value
_USER_CODES: dict[int, str] = {}  # code -> the registered class's name
_REGISTRY_LOCK = threading.Lock()


# --- encoding ------------------------------------------------------------------------------


class _PackerPool(threading.local):
    """Idle msgpack Packers of this thread, one list per nesting depth: creating a Packer costs
    more than packing a small value. A Packer in use is out of its list, so a hook that packs
    again while one is busy (re-entrance) gets another."""

    def __init__(self) -> None:
        self.idle: list[list[msgpack.Packer]] = [[] for _ in range(MAX_NESTING + 1)]


_POOL = _PackerPool()
_POOLED_MAX = 64 * 1024  # a Packer keeps its grown buffer; one that packed more is let go


def _pack(value: Any, depth: int) -> bytes:
    idle = _POOL.idle[depth]
    packer = idle.pop() if idle else msgpack.Packer(default=_DEFAULTS[depth], buf_size=_PACKER_BUFFER, **_PACK_OPTIONS)
    data: bytes = packer.pack(value)  # on an error the packer is dropped, whatever state it is in
    if len(data) <= _POOLED_MAX:
        idle.append(packer)
    return data


def _pack_nested(value: Any, depth: int) -> bytes:
    """Pack the inside of a tuple, set or registered value, one nesting level down."""
    if depth >= MAX_NESTING:
        raise EncodeError(f"values nested more than {MAX_NESTING} deep in tuples, sets or registered types")
    return _pack(value, depth + 1)


def _ext(code: int, data: bytes) -> msgpack.ExtType:
    # ExtType is a namedtuple whose __new__ checks its arguments in Python, which doubles the cost
    # of a small tuple; codes and payloads made here are already right.
    return tuple.__new__(msgpack.ExtType, (code, data))


def _pack_items(value: Any, depth: int) -> bytes:
    return _pack_nested(list(value), depth)


def _packable(value: Any, depth: int) -> Any:
    """The value itself when msgpack packs it natively, else its extension form."""
    cls = type(value)
    if cls in _NATIVE_TYPES and (cls is not int or -(2**63) <= value < 2**64):
        return value
    return _default(value, depth)


def _encode_lazy(obj: Any, depth: int) -> Any:
    """numpy, torch and uuid values: their modules are imported only once such a value exists."""
    module = type(obj).__module__
    if module == "numpy":
        import numpy as np

        if isinstance(obj, np.ndarray):
            _remember_array_type(type(obj), np.ndarray, EXT_NDARRAY, codec_arrays.encode_ndarray)
            return _ext(EXT_NDARRAY, codec_arrays.encode_ndarray(obj))
        if isinstance(obj, np.generic):
            value = obj.item()
            if type(value).__module__ == "numpy":  # longdouble: no Python type holds it
                raise EncodeError(f"numpy scalar of dtype {obj.dtype} cannot be sent")
            return _packable(value, depth)
    elif module.startswith("torch") and "torch" in sys.modules:
        import torch

        if isinstance(obj, torch.Tensor):
            _remember_array_type(type(obj), torch.Tensor, EXT_TENSOR, codec_arrays.encode_tensor)
            return _ext(EXT_TENSOR, codec_arrays.encode_tensor(obj))
    elif module == "uuid" and type(obj) is sys.modules["uuid"].UUID:
        return msgpack.ExtType(EXT_UUID, codec_std.encode_uuid(obj))
    return _MISSING


def _remember_array_type(cls: type, base: type, code: int, encode: Callable[[Any], bytes]) -> None:
    """Encode values of exactly ``base`` (not its subclasses) from now on without looking them up
    (see _ARRAY_ENCODERS), unless an application registered the class itself."""
    if cls is base and cls not in _ENCODERS:
        with _REGISTRY_LOCK:
            if cls not in _ENCODERS:
                _ARRAY_ENCODERS[cls] = (code, _leaf(encode))


# Subclasses of the plain types (IntEnum, StrEnum, OrderedDict, namedtuple, ...) travel as their
# base type; the unbound base methods skip any override of __int__, __str__ and the like.
_BASES: tuple[tuple[type, Callable[[Any], Any]], ...] = (
    (int, int.__int__),
    (float, float.__float__),
    (str, str.__str__),
    (bytes, lambda value: bytes(memoryview(value))),
    (dict, dict),
    (list, list),
    (tuple, tuple),
    (set, set),
    (frozenset, frozenset),
)


def _unsupported(obj: Any) -> EncodeError:
    cls = type(obj)
    return EncodeError(
        f"cannot encode a value of type {cls.__module__}.{cls.__qualname__}; to send it, call "
        f"rstreamer.register_type({cls.__qualname__}, code, encode, decode) with a code in "
        f"{USER_CODES.start}..{USER_CODES.stop - 1}, in the web processes and in the workers"
    )


def _default(obj: Any, depth: int = 0) -> Any:
    """The hook msgpack calls for every value that is not exactly one of its own types."""
    entry = _ENCODERS.get(type(obj)) or _ARRAY_ENCODERS.get(type(obj))
    if entry is not None:
        code, encode = entry
        return _ext(code, encode(obj, depth))
    value = _encode_lazy(obj, depth)
    if value is not _MISSING:
        return value
    for base, convert in _BASES:
        if isinstance(obj, base):
            return _packable(convert(obj), depth)
    raise _unsupported(obj)


_DEFAULTS = tuple(functools.partial(_default, depth=depth) for depth in range(MAX_NESTING + 1))


def packb(value: Any) -> bytes:
    """Encode a value for the broker.

    Raises:
        EncodeError: the value (or a value inside it) has a type that cannot cross the broker.
    """
    try:
        entry = _ARRAY_ENCODERS.get(type(value))
        if entry is not None:  # an array or a tensor itself: msgpack packs its ext without a hook
            code, encode = entry
            return _pack(_ext(code, encode(value, 0)), 0)
        return _pack(value, 0)
    except EncodeError:
        raise
    except (TypeError, ValueError, OverflowError, RecursionError) as exc:
        raise EncodeError(str(exc)) from exc


def packb_legacy(value: Any) -> bytes:
    """Encode a value as wire version 1 (rstreamer before the standard-type extensions) did,
    for an answer to a client of that version: tuples and sets as lists, numpy arrays and torch
    tensors as extensions, nothing else. A worker of this version answers old clients so
    during a rolling upgrade.

    Raises:
        EncodeError: the value holds a type that version 1 could not send.
    """
    try:
        packed: bytes = msgpack.packb(value, use_bin_type=True, datetime=False, default=_legacy_default)
        return packed
    except EncodeError:
        raise
    except (TypeError, ValueError, OverflowError, RecursionError) as exc:
        raise EncodeError(str(exc)) from exc


def _legacy_default(obj: Any) -> Any:
    if isinstance(obj, (set, frozenset)):
        return list(obj)
    module = type(obj).__module__
    if module == "numpy" or module.startswith("torch"):
        value = _encode_lazy(obj, 0)
        if value is not _MISSING:
            return value
    raise EncodeError(f"a client of wire version 1 cannot receive a value of type {type(obj).__qualname__}")


# --- decoding ------------------------------------------------------------------------------


class _Budget:
    """Counts decoded objects as msgpack completes each container: one for the container and one
    per item (a map's keys and values both count)."""

    __slots__ = ("limit", "left")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.left = limit

    def _spend(self, count: int) -> None:
        self.left -= count
        if self.left < 0:
            raise DecodeError(
                f"message holds more than {self.limit} objects; send large numeric data as a numpy array"
            )

    def on_list(self, items: list[Any]) -> list[Any]:
        self._spend(1 + len(items))
        return items

    def on_map(self, items: dict[Any, Any]) -> dict[Any, Any]:
        self._spend(1 + 2 * len(items))
        return items


def _counting_options(depth: int, budget: _Budget) -> dict[str, Any]:
    return {
        "ext_hook": functools.partial(_ext_hook, depth=depth, budget=budget),
        "list_hook": budget.on_list,
        "object_hook": budget.on_map,
        # refuse one huge container from its header, before it is built
        "max_array_len": budget.limit,
        "max_map_len": budget.limit // 2,
        **_UNPACK_OPTIONS,
    }


def _unpack_on_heap(data: bytes, options: dict[str, Any]) -> Any:
    # unpackb keeps its parse stack (~40 KiB) on the C stack and nested values each add one: six
    # levels overflow a 256 KiB thread stack. An Unpacker keeps it on the heap, but is slower to make.
    unpacker = msgpack.Unpacker(max_buffer_size=max(len(data), 1), **options)
    unpacker.feed(data)
    value = unpacker.unpack()
    if unpacker.tell() != len(data):
        raise DecodeError("extension value has trailing bytes")
    return value


def _unpack_nested(data: bytes, depth: int, budget: _Budget | None) -> Any:
    """Unpack the inside of a tuple, set or registered value, one nesting level down."""
    if depth > MAX_NESTING:
        raise DecodeError(f"values nested more than {MAX_NESTING} deep in tuples, sets or registered types")
    if budget is not None:
        options = _counting_options(depth, budget)
        return msgpack.unpackb(data, **options) if depth <= _C_STACK_NESTING else _unpack_on_heap(data, options)
    if depth <= _C_STACK_NESTING:
        # keywords spelt out: **options into msgpack's Cython functions is several times slower
        return msgpack.unpackb(data, ext_hook=_EXT_HOOKS[depth], raw=False, strict_map_key=False)
    return _unpack_on_heap(data, {"ext_hook": _EXT_HOOKS[depth], **_UNPACK_OPTIONS})


def _unknown_code(code: int) -> DecodeError:
    if code in USER_CODES:
        return DecodeError(
            f"unknown extension type {code}: register its class with rstreamer.register_type "
            "in this process too"
        )
    return DecodeError(f"unknown extension type {code}")


def _ext_hook(code: int, data: bytes, depth: int = 0, budget: _Budget | None = None) -> Any:
    try:
        leaf = _LEAF_DECODERS.get(code)
        if leaf is not None:
            return leaf(data)
        rebuild = _NESTED_DECODERS.get(code)
        if rebuild is not None:
            return rebuild(_unpack_nested(data, depth + 1, budget))
    except DecodeError:
        raise
    except Exception as exc:
        raise DecodeError(f"corrupt extension value of type {code}: {exc}") from exc
    raise _unknown_code(code)


_EXT_HOOKS = tuple(functools.partial(_ext_hook, depth=depth) for depth in range(MAX_NESTING + 1))


def _unpack_counted(data: bytes | bytearray | memoryview, limit: int) -> Any:
    try:
        return msgpack.unpackb(data, **_counting_options(0, _Budget(limit)))
    except ValueError as exc:
        if "exceeds max_" not in str(exc):  # msgpack's words for a container over max_*_len
            raise
        raise DecodeError(f"message holds more than {limit} objects: {exc}") from exc


def unpackb(data: bytes, max_bytes: int = DEFAULT_MAX_BYTES, max_objects: int | None = None) -> Any:
    """Decode bytes from the broker.

    Args:
        data: one msgpack message.
        max_bytes: the largest message accepted.
        max_objects: the most objects the decoded value may hold, counting one for each
            container and one for each item in it (a map's keys and values both count);
            ``max(max_bytes // 8, 1024)`` when None.

    Raises:
        DecodeError: garbage, an unknown extension type, or a message over either limit.
    """
    if isinstance(data, (bytes, bytearray)):
        size = len(data)
    elif isinstance(data, memoryview):
        size = data.nbytes
    else:
        raise DecodeError(f"expected bytes, got {type(data).__name__}")
    if size > max_bytes:
        raise DecodeError(f"message of {size} bytes exceeds the limit of {max_bytes}")
    limit = max_objects
    if limit is None:
        limit = max_bytes // BYTES_PER_OBJECT
        if limit < MIN_MAX_OBJECTS:  # spelt out: max() costs a tenth of a small message's decode
            limit = MIN_MAX_OBJECTS
    try:
        if 2 * size <= limit:
            # Every value takes at least one byte and counts at most twice (as an item and as a
            # container): this message cannot exceed the budget, so msgpack runs without hooks.
            return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)
        return _unpack_counted(data, limit)
    except DecodeError:
        raise
    except Exception as exc:
        raise DecodeError(f"not a valid msgpack message: {exc}") from exc


# --- the extension types -------------------------------------------------------------------


def _leaf(encode: Callable[[Any], bytes]) -> _Encoder:
    return lambda value, depth: encode(value)


def _items(items: Any) -> list[Any]:
    if type(items) is not list:
        raise DecodeError(f"invalid payload of a tuple or set: {items!r:.80}")
    return items


def _as_tuple(items: Any) -> tuple[Any, ...]:
    return tuple(_items(items))


def _as_set(items: Any) -> set[Any]:
    return set(_items(items))


def _as_frozenset(items: Any) -> frozenset[Any]:
    return frozenset(_items(items))


# (class, code, payload encoder, payload decoder); UUID is in _encode_lazy and below.
_LEAF_TYPES: tuple[tuple[type, int, Callable[[Any], bytes], Callable[[bytes], Any]], ...] = (
    (int, EXT_BIGINT, codec_std.encode_bigint, codec_std.decode_bigint),  # only ints beyond 64 bits get here
    (complex, EXT_COMPLEX, codec_std.encode_complex, codec_std.decode_complex),
    (datetime.datetime, EXT_DATETIME, codec_std.encode_datetime, codec_std.decode_datetime),
    (datetime.date, EXT_DATE, codec_std.encode_date, codec_std.decode_date),
    (datetime.time, EXT_TIME, codec_std.encode_time, codec_std.decode_time),
    (datetime.timedelta, EXT_TIMEDELTA, codec_std.encode_timedelta, codec_std.decode_timedelta),
    (decimal.Decimal, EXT_DECIMAL, codec_std.encode_decimal, codec_std.decode_decimal),
)
for _cls, _code, _encode, _decode in _LEAF_TYPES:
    _ENCODERS[_cls] = (_code, _leaf(_encode))
    _LEAF_DECODERS[_code] = _decode
for _cls, _code, _rebuild in (
    (tuple, EXT_TUPLE, _as_tuple),
    (set, EXT_SET, _as_set),
    (frozenset, EXT_FROZENSET, _as_frozenset),
):
    _ENCODERS[_cls] = (_code, _pack_items)
    _NESTED_DECODERS[_code] = _rebuild
_LEAF_DECODERS[EXT_NDARRAY] = codec_arrays.decode_ndarray
_LEAF_DECODERS[EXT_TENSOR] = codec_arrays.decode_tensor
_LEAF_DECODERS[EXT_UUID] = codec_std.decode_uuid
_BUILTIN_TYPES = frozenset(_ENCODERS) | _NATIVE_TYPES


# --- registration --------------------------------------------------------------------------


def _user_encoder(name: str, encode: Callable[[Any], Any]) -> _Encoder:
    def encoder(value: Any, depth: int) -> bytes:
        try:
            state = encode(value)
        except EncodeError:
            raise
        except Exception as exc:
            raise EncodeError(f"the encoder registered for {name} failed: {exc!r}") from exc
        return _pack_nested(state, depth)

    return encoder


def _check_registration(cls: type, code: int) -> None:
    if not isinstance(cls, type):
        raise ConfigError(f"register_type needs a class, got {cls!r:.80}")
    if cls in _BUILTIN_TYPES:
        raise ConfigError(f"{cls.__qualname__} is carried by rstreamer already")
    if type(code) is not int or code not in USER_CODES:
        raise ConfigError(
            f"extension code {code!r} is outside {USER_CODES.start}..{USER_CODES.stop - 1} "
            f"(0..{USER_CODES.start - 1} are rstreamer's own)"
        )
    if code in _USER_CODES:
        raise ConfigError(f"extension code {code} is already registered for {_USER_CODES[code]}")
    if cls in _ENCODERS:
        raise ConfigError(f"{cls.__qualname__} is already registered with code {_ENCODERS[cls][0]}")


def register_type(cls: type[T], code: int, encode: Callable[[T], Any], decode: Callable[[Any], T]) -> None:
    """Let values of one class cross the broker, as msgpack extension type ``code``.

    Register the class with the same code in every process that sends or receives it (the web
    processes and the workers), e.g. in a module that both import. Only values of exactly
    ``cls`` use it, not of its subclasses. The codec never falls back to pickle.

    Args:
        cls: the class.
        code: the extension code, 64..127 (0..63 are rstreamer's own); part of the wire format.
        encode: turns a value into something :func:`packb` carries (plain values, tuples,
            arrays, other registered values), e.g. a dict of its fields.
        decode: turns that back into a value of ``cls``; it sees data from the broker, so it
            should check what it gets.

    Raises:
        ConfigError: the code is out of range or taken, or the class is already carried.

    Example::

        register_type(Point, 64, lambda p: [p.x, p.y], lambda xy: Point(*xy))
    """
    name = f"{cls.__module__}.{cls.__qualname__}" if isinstance(cls, type) else repr(cls)
    with _REGISTRY_LOCK:
        _check_registration(cls, code)
        _ENCODERS[cls] = (code, _user_encoder(name, encode))
        _ARRAY_ENCODERS.pop(cls, None)  # the application's own encoding of the class comes first
        _NESTED_DECODERS[code] = decode
        _USER_CODES[code] = name


def _unregister_type(cls: type) -> None:
    """Forget a registered class (for tests)."""
    with _REGISTRY_LOCK:
        code, _ = _ENCODERS[cls]
        if code not in _USER_CODES:
            raise ConfigError(f"{cls.__qualname__} is not a registered class")
        del _ENCODERS[cls]
        del _NESTED_DECODERS[code], _USER_CODES[code]
