"""Payloads of numpy arrays and torch tensors: a msgpack (dtype, shape) header, then the raw bytes.

numpy and torch are imported only when such a value is met, so a web process needs neither.
Decoders check the dtype against a list of plain kinds and the byte count against the shape
before allocating anything; a dtype string is parsed, never unpickled.
"""
from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import msgpack

from ..errors import DecodeError, EncodeError

# numpy kinds whose items are plain bytes: bool, ints, floats, complex, datetimes, S, U, void.
_PLAIN_KINDS = frozenset("biufcmMSUV")


def _is_plain(dtype: Any) -> bool:
    return (
        dtype.kind in _PLAIN_KINDS
        and not dtype.hasobject
        and dtype.fields is None
        and dtype.subdtype is None
        and dtype.itemsize > 0
    )


@functools.lru_cache(maxsize=1024)
def _ndarray_header(dtype: Any, shape: tuple[int, ...]) -> bytes:
    """The (dtype, shape) header of an array's payload, or EncodeError for a dtype that cannot be
    sent. Cached: a model answers arrays of a few dtypes and shapes, and writing the header cost
    more than copying a 768-float vector's bytes (issue 26)."""
    if not _is_plain(dtype):
        raise EncodeError(f"numpy dtype {dtype} cannot be sent; use a plain numeric dtype")
    header: bytes = msgpack.packb([dtype.str, list(shape)])
    return header


def encode_ndarray(array: Any) -> bytes:
    """A numpy array as dtype, shape and raw bytes (object dtypes are refused)."""
    # not np.ascontiguousarray: it turns a 0-d array into a 1-d one.
    data = array if array.flags.c_contiguous else array.copy(order="C")
    raw: bytes = data.tobytes()
    return _ndarray_header(data.dtype, data.shape) + raw


def encode_tensor(tensor: Any) -> bytes:
    """A torch tensor as its CPU array's dtype, shape and raw bytes."""
    import torch

    try:
        data = tensor.detach()
        if data.layout != torch.strided:  # sparse COO, CSR, ...
            data = data.to_dense()
        # conj() and neg() views cannot be reinterpreted as bytes until they are materialised.
        data = data.resolve_conj().resolve_neg().cpu().contiguous()
        dtype = str(data.dtype).removeprefix("torch.")
        # numpy lacks bfloat16, so the raw bytes go through a byte view of the storage.
        flat = data.reshape(-1)
        if flat.numel() == 1 and flat.stride(0) != 1:
            # a one-item slice such as x[::2][:1] counts as contiguous but keeps its stride,
            # and view() refuses it
            flat = flat.clone(memory_format=torch.contiguous_format)
        raw = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as exc:
        # meta tensors, quantized tensors and the like
        raise EncodeError(f"torch tensor of dtype {tensor.dtype} cannot be sent: {exc}") from exc
    header: bytes = msgpack.packb([dtype, list(data.shape)])
    return header + raw


class _Header(NamedTuple):
    encoded: bytes
    dtype_name: str
    shape: tuple[int, ...]


# The last header split (see _split_header); None before the first.
_last_header: _Header | None = None


def _split_header(data: bytes) -> tuple[str, tuple[int, ...], memoryview]:
    """Split an extension payload into its (dtype name, shape) header and its raw bytes."""
    global _last_header
    last = _last_header
    if last is not None and data.startswith(last.encoded):
        # msgpack reads a value from its first byte on: a payload that starts with the bytes of
        # the last header holds that header. A client receiving one shape of array again and
        # again splits it without making an Unpacker (half its decode of a 768-float vector).
        return last.dtype_name, last.shape, memoryview(data)[len(last.encoded):]
    unpacker = msgpack.Unpacker(max_buffer_size=max(len(data), 1))
    unpacker.feed(data)
    header = unpacker.unpack()
    if not (isinstance(header, list) and len(header) == 2 and isinstance(header[0], str)):
        raise DecodeError(f"invalid array header {header!r:.100}")
    dtype_name, shape = header
    if not (isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape)):
        raise DecodeError(f"invalid array shape {shape!r:.100}")
    size = unpacker.tell()
    _last_header = _Header(bytes(data[:size]), dtype_name, tuple(shape))  # one assignment: safe across threads
    return dtype_name, tuple(shape), memoryview(data)[size:]


def _check_size(shape: tuple[int, ...], itemsize: int, raw: memoryview) -> None:
    # Without this check a short payload could declare a huge shape (a memory bomb)
    # or an uninitialised one.
    expected = math.prod(shape) * itemsize
    if expected != len(raw):
        raise DecodeError(f"shape {shape} needs {expected} bytes, the payload has {len(raw)}")


def decode_ndarray(data: bytes) -> Any:
    """The numpy array that :func:`encode_ndarray` wrote."""
    import numpy as np

    dtype_name, shape, raw = _split_header(data)
    dtype = _numpy_dtype(dtype_name)
    _check_size(shape, dtype.itemsize, raw)
    if dtype.kind == "b" and np.frombuffer(raw, np.uint8).max(initial=0) > 1:
        raise DecodeError("boolean array holds bytes other than 0 and 1")
    # copy(): frombuffer alone gives a read-only, misaligned view of msgpack's bytes.
    return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()


@functools.lru_cache(maxsize=256)
def _numpy_dtype(name: str) -> Any:
    """The plain numpy dtype a header names (parsed from its string; never unpickled), or
    DecodeError. Cached: parsing it cost as much as copying a 768-float vector."""
    import numpy as np

    try:
        dtype = np.dtype(name)
    except (TypeError, ValueError) as exc:
        raise DecodeError(f"numpy dtype {name!r} is refused: {exc}") from exc
    if not _is_plain(dtype):
        raise DecodeError(f"numpy dtype {name!r} is refused")
    return dtype


@functools.cache
def _torch_dtypes() -> dict[str, Any]:
    import torch

    # vars(), not getattr(): torch's module __getattr__ imports submodules on demand.
    return {
        str(value).removeprefix("torch."): value
        for value in vars(torch).values()
        if isinstance(value, torch.dtype)
    }


def decode_tensor(data: bytes) -> Any:
    """The torch tensor that :func:`encode_tensor` wrote (on the CPU)."""
    import torch

    dtype_name, shape, raw = _split_header(data)
    dtype = _torch_dtypes().get(dtype_name)
    if dtype is None:
        raise DecodeError(f"unknown tensor dtype {dtype_name!r}")
    _check_size(shape, dtype.itemsize, raw)
    if len(raw) == 0:
        return torch.empty(shape, dtype=dtype)
    # bytearray: torch.frombuffer needs a writable buffer it may keep.
    tensor = torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape)
    if dtype == torch.bool and bool((tensor.view(torch.uint8) > 1).any()):
        raise DecodeError("boolean tensor holds bytes other than 0 and 1")
    return tensor
