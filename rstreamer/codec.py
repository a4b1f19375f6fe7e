"""msgpack encoding of everything that crosses the broker; never pickle.

numpy arrays and torch tensors travel as extension types holding (dtype, shape, raw bytes).
numpy and torch are imported only when such a value is met, so a web process needs neither.
"""
from __future__ import annotations

import functools
import math
import sys
from typing import Any

import msgpack

from .errors import DecodeError, EncodeError

EXT_NDARRAY = 1
EXT_TENSOR = 2
DEFAULT_MAX_BYTES = 64 * 1024 * 1024
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


def _encode_ndarray(array: Any) -> msgpack.ExtType:
    if not _is_plain(array.dtype):
        raise EncodeError(f"numpy dtype {array.dtype} cannot be sent; use a plain numeric dtype")
    # not np.ascontiguousarray: it turns a 0-d array into a 1-d one.
    data = array if array.flags.c_contiguous else array.copy(order="C")
    header = msgpack.packb([data.dtype.str, list(data.shape)])
    return msgpack.ExtType(EXT_NDARRAY, header + data.tobytes())


def _encode_tensor(tensor: Any) -> msgpack.ExtType:
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
    header = msgpack.packb([dtype, list(data.shape)])
    return msgpack.ExtType(EXT_TENSOR, header + raw)


def _default(obj: Any) -> Any:
    module = type(obj).__module__
    if module == "numpy":
        import numpy as np

        if isinstance(obj, np.ndarray):
            return _encode_ndarray(obj)
        if isinstance(obj, np.generic):
            return obj.item()
    if module.startswith("torch") and "torch" in sys.modules:
        import torch

        if isinstance(obj, torch.Tensor):
            return _encode_tensor(obj)
    if isinstance(obj, (set, frozenset)):
        return list(obj)
    if isinstance(obj, int):  # msgpack hands over the ints that do not fit in 64 bits
        raise EncodeError(f"integer {obj} does not fit in 64 bits")
    raise EncodeError(f"cannot encode a value of type {type(obj).__name__}")


def _split_header(data: bytes) -> tuple[str, tuple[int, ...], memoryview]:
    """Split an extension payload into its (dtype name, shape) header and its raw bytes."""
    unpacker = msgpack.Unpacker(max_buffer_size=max(len(data), 1))
    unpacker.feed(data)
    header = unpacker.unpack()
    if not (isinstance(header, list) and len(header) == 2 and isinstance(header[0], str)):
        raise DecodeError(f"invalid array header {header!r:.100}")
    dtype_name, shape = header
    if not (isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape)):
        raise DecodeError(f"invalid array shape {shape!r:.100}")
    return dtype_name, tuple(shape), memoryview(data)[unpacker.tell():]


def _check_size(shape: tuple[int, ...], itemsize: int, raw: memoryview) -> None:
    # Without this check a short payload could declare a huge shape (a memory bomb)
    # or an uninitialised one.
    expected = math.prod(shape) * itemsize
    if expected != len(raw):
        raise DecodeError(f"shape {shape} needs {expected} bytes, the payload has {len(raw)}")


def _decode_ndarray(data: bytes) -> Any:
    import numpy as np

    dtype_name, shape, raw = _split_header(data)
    dtype = np.dtype(dtype_name)  # parses a type string; never unpickles
    if not _is_plain(dtype):
        raise DecodeError(f"numpy dtype {dtype_name!r} is refused")
    _check_size(shape, dtype.itemsize, raw)
    if dtype.kind == "b" and np.frombuffer(raw, np.uint8).max(initial=0) > 1:
        raise DecodeError("boolean array holds bytes other than 0 and 1")
    # copy(): frombuffer alone gives a read-only, misaligned view of msgpack's bytes.
    return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()


@functools.cache
def _torch_dtypes() -> dict[str, Any]:
    import torch

    # vars(), not getattr(): torch's module __getattr__ imports submodules on demand.
    return {
        str(value).removeprefix("torch."): value
        for value in vars(torch).values()
        if isinstance(value, torch.dtype)
    }


def _decode_tensor(data: bytes) -> Any:
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


def _ext_hook(code: int, data: bytes) -> Any:
    try:
        if code == EXT_NDARRAY:
            return _decode_ndarray(data)
        if code == EXT_TENSOR:
            return _decode_tensor(data)
    except DecodeError:
        raise
    except Exception as exc:
        raise DecodeError(f"corrupt extension value: {exc}") from exc
    raise DecodeError(f"unknown extension type {code}")


def packb(value: Any) -> bytes:
    """Encode a value; raises EncodeError for what msgpack cannot carry."""
    try:
        return msgpack.packb(value, default=_default, use_bin_type=True, datetime=False)
    except EncodeError:
        raise
    except (TypeError, ValueError, OverflowError) as exc:
        raise EncodeError(str(exc)) from exc


def unpackb(data: bytes, max_bytes: int = DEFAULT_MAX_BYTES) -> Any:
    """Decode bytes from the broker; raises DecodeError on garbage or oversize input."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise DecodeError(f"expected bytes, got {type(data).__name__}")
    size = data.nbytes if isinstance(data, memoryview) else len(data)
    if size > max_bytes:
        raise DecodeError(f"message of {size} bytes exceeds the limit of {max_bytes}")
    try:
        return msgpack.unpackb(
            data, ext_hook=_ext_hook, raw=False, strict_map_key=False, use_list=True
        )
    except DecodeError:
        raise
    except Exception as exc:
        raise DecodeError(f"not a valid msgpack message: {exc}") from exc
