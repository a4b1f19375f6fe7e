"""Unit tests of rstreamer.codec.core: round-trips, refusals, and hostile input (no Redis)."""
from __future__ import annotations

import math
import pathlib
import pickle
import subprocess
import sys
import time
import tracemalloc

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rstreamer.codec import core as codec
from rstreamer.codec.core import DEFAULT_MAX_BYTES, EXT_NDARRAY, EXT_TENSOR, packb, unpackb
from rstreamer.errors import CodecError, DecodeError, EncodeError
from support.values import assert_same, roundtrip

try:  # imported at collection, so that no single test pays for torch's slow import
    import torch as _torch
except ImportError:  # torch is an optional extra
    _torch = None


@pytest.fixture
def torch():
    if _torch is None:
        pytest.skip("torch is not installed")
    return _torch



def ext(code: int, header, raw: bytes = b"") -> bytes:
    """A message holding one extension value with a hand-made (dtype, shape) header."""
    return msgpack.packb(msgpack.ExtType(code, msgpack.packb(header) + raw))


# --- plain values -------------------------------------------------------------------------


def test_str_and_bytes_stay_distinct():
    # service-streamer's codec returned bytes for str; here each keeps its type.
    assert packb("abc") != packb(b"abc")
    assert_same(roundtrip("abc"), "abc")
    assert_same(roundtrip(b"abc"), b"abc")
    assert_same(roundtrip({"k": b"v", b"k": "v"}), {"k": b"v", b"k": "v"})


def test_bytearray_and_memoryview_decode_as_bytes():
    assert_same(roundtrip(bytearray(b"\x00\xff")), b"\x00\xff")
    assert_same(roundtrip(memoryview(b"img")), b"img")


@pytest.mark.parametrize(
    "value",
    [
        0,
        1,
        -1,
        2**63 - 1,
        -(2**63),
        2**64 - 1,
        0.1,
        1.5,
        -0.0,
        float("inf"),
        float("-inf"),
        None,
        True,
        False,
        "",
        "é 🙂 \x00",
        b"",
        b"\x00\xff\x80",
    ],
    ids=repr,
)
def test_scalars_roundtrip_with_their_type(value):
    result = roundtrip(value)
    assert_same(result, value)
    if isinstance(value, float):
        assert math.copysign(1.0, result) == math.copysign(1.0, value)


def test_nan_roundtrips():
    assert math.isnan(roundtrip(float("nan")))


def test_bool_is_not_turned_into_int():
    assert roundtrip(True) is True
    assert roundtrip(False) is False
    assert_same(roundtrip([1, True, 0, False]), [1, True, 0, False])


def test_nested_lists_and_dicts_with_int_keys():
    value = {1: "one", -2: [1, 2.5, {3: None, "x": [b"y", []]}], "s": {}, 0: [[[]]]}
    assert_same(roundtrip(value), value)


def test_tuples_sets_and_frozensets_keep_their_type():
    # service-streamer (pickle) kept them; they used to come back as lists
    assert_same(roundtrip((1, (2, "a"))), (1, (2, "a")))
    assert_same(roundtrip([("n0", "tabby")]), [("n0", "tabby")])
    assert_same(roundtrip(()), ())
    assert_same(roundtrip({3, 1, 2}), {1, 2, 3})
    assert_same(roundtrip(set()), set())
    assert_same(roundtrip(frozenset({"a", (1, 2)})), frozenset({"a", (1, 2)}))
    assert_same(roundtrip(([1, [2]], {"k": (3,)})), ([1, [2]], {"k": (3,)}))


@pytest.mark.parametrize("value", [2**64, -(2**63) - 1, 10**30, -(10**30), 2**70, 2**1000 + 1, -(2**4000)], ids=str)
def test_ints_beyond_64_bits_roundtrip(value):
    assert_same(roundtrip(value), value)
    assert_same(roundtrip([value, {value: -value}]), [value, {value: -value}])


@pytest.mark.parametrize("value", [-(2**63) - 1, -(2**63), 2**64 - 1, 2**64], ids=str)
def test_an_int_subclass_at_the_64_bit_edges_travels_as_its_int(value):
    class Big(int):
        pass

    assert_same(roundtrip(Big(value)), value)  # natively inside int64..uint64, as a big integer outside


class _Plain:
    pass


@pytest.mark.parametrize(
    "value",
    [
        object(),
        _Plain(),
        [1, _Plain()],
        {"k": object()},
        (1, object()),
        {("k", _Plain())},
        len,
        type,
        range(3),
    ],
    ids=lambda v: type(v).__name__,
)
def test_unsupported_types_raise_encode_error(value):
    with pytest.raises(EncodeError, match=r"rstreamer\.register_type\(.*64\.\.127"):
        packb(value)


def test_dict_with_tuple_and_frozenset_keys_roundtrips():
    # msgpack used to write a tuple key as an array, which cannot be a dict key when decoded
    value = {(1, 2): "tuple key", ("a", (b"b", None)): 1, frozenset({1}): [()]}
    result = roundtrip(value)
    assert_same(result, value)
    assert result[(1, 2)] == "tuple key"


def test_self_referencing_list_raises_encode_error():
    value: list = []
    value.append(value)
    with pytest.raises(EncodeError):
        packb(value)


def test_error_classes():
    assert issubclass(EncodeError, CodecError) and issubclass(EncodeError, TypeError)
    assert issubclass(DecodeError, CodecError) and issubclass(DecodeError, ValueError)
    assert CodecError.http_status == 400


def test_plain_values_import_neither_numpy_nor_torch():
    # A web process must be able to encode and decode without numpy or torch installed.
    script = (
        "import sys; from rstreamer.codec.core import packb, unpackb;"
        "assert unpackb(packb({'a': [1, b'x', 2.5]})) == {'a': [1, b'x', 2.5]};"
        "bad = [m for m in ('numpy', 'torch') if m in sys.modules];"
        "assert not bad, bad"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=30)
    assert result.returncode == 0, result.stderr.decode()


# --- numpy ---------------------------------------------------------------------------------

NUMPY_DTYPES = ["float16", "float32", "float64", "bool", "int64", "uint8", "int8", "int32", "complex64"]


def _sample(dtype: str, shape=(2, 3)) -> np.ndarray:
    values = np.arange(math.prod(shape)).reshape(shape) - 2
    return values.astype(dtype)


def assert_same_array(result, expected):
    assert type(result) is np.ndarray
    assert result.dtype == expected.dtype
    assert result.shape == expected.shape
    np.testing.assert_array_equal(result, expected)


@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
def test_ndarray_roundtrip(dtype):
    array = _sample(dtype)
    assert_same_array(roundtrip(array), array)


def test_float_arrays_keep_special_values():
    array = np.array([np.nan, np.inf, -np.inf, -0.0, 1e-300], dtype=np.float64)
    result = roundtrip(array)
    np.testing.assert_array_equal(result, array)
    assert np.signbit(result[3])


def test_decoded_ndarray_is_writable_aligned_and_owns_its_memory():
    result = roundtrip(np.arange(10, dtype=np.float32))
    assert result.flags.writeable and result.flags.aligned and result.flags.c_contiguous
    result += 1  # a model may work in place
    assert result[0] == 1.0


@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
def test_zero_dim_ndarray_stays_zero_dim(dtype):
    array = np.array(1, dtype=dtype)
    result = roundtrip(array)
    assert_same_array(result, array)
    assert result.ndim == 0


@pytest.mark.parametrize("shape", [(0,), (0, 3), (2, 0, 4)])
@pytest.mark.parametrize("dtype", ["float32", "bool", "int64"])
def test_empty_ndarray(shape, dtype):
    array = np.zeros(shape, dtype=dtype)
    assert_same_array(roundtrip(array), array)


@pytest.mark.parametrize(
    "view",
    [
        lambda a: a[::2],
        lambda a: a.T,
        lambda a: a[:, 1],
        lambda a: a[1:, ::-1],
        lambda a: np.asfortranarray(a),
        lambda a: a[::2][:1],
        lambda a: np.broadcast_to(a[:1], (4, 5)),
    ],
    ids=["step", "transpose", "column", "reversed", "fortran", "one-item-slice", "broadcast"],
)
def test_non_contiguous_ndarray(view):
    array = view(np.arange(20, dtype=np.float32).reshape(4, 5))
    assert not array.flags.c_contiguous or array.base is not None
    result = roundtrip(array)
    assert_same_array(result, np.ascontiguousarray(array).reshape(array.shape))
    assert result.flags.c_contiguous


def test_big_endian_ndarray_keeps_values():
    array = np.arange(5, dtype=">i4")
    result = roundtrip(array)
    assert result.dtype == np.dtype(">i4")
    assert result.tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(
    "array",
    [
        np.array(["ab", "c"]),
        np.array([b"ab", b"c"]),
        np.array(["2024-01-01"], dtype="datetime64[D]"),
        np.array([5], dtype="timedelta64[s]"),
    ],
    ids=["unicode", "bytes", "datetime64", "timedelta64"],
)
def test_fixed_width_non_numeric_ndarrays(array):
    assert_same_array(roundtrip(array), array)


def test_ndarrays_inside_containers():
    value = {"image": np.ones((2, 2), np.uint8), "boxes": [np.zeros(4, np.float32), "label"]}
    result = roundtrip(value)
    assert_same_array(result["image"], value["image"])
    assert_same_array(result["boxes"][0], value["boxes"][0])
    assert result["boxes"][1] == "label"


@pytest.mark.parametrize(
    "scalar, expected",
    [
        (np.float16(1.5), 1.5),
        (np.float32(1.5), 1.5),
        (np.float64(0.1), 0.1),
        (np.int8(-3), -3),
        (np.int64(2**62), 2**62),
        (np.uint8(255), 255),
        (np.uint64(2**64 - 1), 2**64 - 1),
        (np.bool_(True), True),
        (np.bool_(False), False),
        (np.str_("s"), "s"),
        (np.bytes_(b"b"), b"b"),
    ],
    ids=lambda v: type(v).__name__,
)
def test_numpy_scalars_become_python_values(scalar, expected):
    assert_same(roundtrip(scalar), expected)
    assert_same(roundtrip([scalar]), [expected])


def test_numpy_complex_scalar_becomes_complex():
    assert_same(roundtrip(np.complex64(1 + 2j)), 1 + 2j)


def test_numpy_scalar_without_a_python_type_is_refused():
    with pytest.raises(EncodeError, match="numpy scalar of dtype .* cannot be sent"):
        packb(np.longdouble(1.5))


@pytest.mark.parametrize(
    "array",
    [
        np.array([1, "a", None], dtype=object),
        np.array([], dtype=object),
        np.zeros(2, dtype=[("a", "<i4"), ("b", "<f8")]),
        np.zeros(2, dtype=[("a", "O")]),
        np.zeros(2, dtype=np.dtypes.StringDType()),
        np.ma.array([1, 2], mask=[0, 1]),
    ],
    ids=["object", "empty-object", "structured", "structured-object", "stringdtype", "masked"],
)
def test_object_and_structured_arrays_are_refused(array):
    with pytest.raises(EncodeError):
        packb(array)
    with pytest.raises(EncodeError):
        packb({"nested": [array]})


# --- torch ---------------------------------------------------------------------------------

TORCH_DTYPES = ["float16", "bfloat16", "float32", "float64", "bool", "int64", "uint8", "int8", "complex64"]


def _tensor(torch, dtype_name: str, shape=(2, 3)):
    values = torch.arange(math.prod(shape)).reshape(shape) - 2
    return values.to(getattr(torch, dtype_name))


def assert_same_tensor(torch, result, expected):
    assert isinstance(result, torch.Tensor)
    assert result.dtype == expected.dtype
    assert result.shape == expected.shape
    assert result.device.type == "cpu"
    assert not result.requires_grad
    assert torch.equal(result, expected.detach())


@pytest.mark.parametrize("dtype", TORCH_DTYPES)
def test_tensor_roundtrip(torch, dtype):
    tensor = _tensor(torch, dtype)
    assert_same_tensor(torch, roundtrip(tensor), tensor)


@pytest.mark.parametrize("dtype", TORCH_DTYPES)
def test_zero_dim_tensor(torch, dtype):
    tensor = torch.tensor(3).to(getattr(torch, dtype))
    result = roundtrip(tensor)
    assert_same_tensor(torch, result, tensor)
    assert result.dim() == 0


@pytest.mark.parametrize("shape", [(0,), (0, 3), (2, 0, 4)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "bool", "int64"])
def test_empty_tensor(torch, shape, dtype):
    tensor = torch.zeros(shape, dtype=getattr(torch, dtype))
    assert_same_tensor(torch, roundtrip(tensor), tensor)


@pytest.mark.parametrize(
    "view",
    [
        lambda t: t[::2],
        lambda t: t.T,
        lambda t: t[:, 1],
        lambda t: t[1:, 2:],
        lambda t: t.flip(0),
        lambda t: t[::2][:1],
        lambda t: t[0, ::2][:1],
        lambda t: t[::2][1, 3],
        lambda t: t[:1].expand(4, 5),
    ],
    ids=["step", "transpose", "column", "slice", "flip", "one-row", "one-strided-item", "item", "expand"],
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "bool"])
def test_non_contiguous_tensor(torch, view, dtype):
    tensor = view(_tensor(torch, dtype, (4, 5)))
    result = roundtrip(tensor)
    assert_same_tensor(torch, result, tensor)
    assert result.is_contiguous()


def test_tensor_requiring_grad_is_sent_detached(torch):
    tensor = torch.linspace(0, 1, 5, requires_grad=True) * 2
    assert tensor.requires_grad
    assert_same_tensor(torch, roundtrip(tensor), tensor)
    parameter = torch.nn.Parameter(torch.ones(2, 2))
    assert_same_tensor(torch, roundtrip(parameter), parameter)


def test_conjugate_and_negative_views_are_materialised(torch):
    complex_tensor = torch.tensor([1 + 2j, 3 - 4j])
    conj = complex_tensor.conj()
    assert conj.is_conj()
    assert_same_tensor(torch, roundtrip(conj), conj.resolve_conj())
    neg = complex_tensor.conj().imag
    assert neg.is_neg()
    assert_same_tensor(torch, roundtrip(neg), neg.resolve_neg())
    assert roundtrip(neg).tolist() == [-2.0, 4.0]


def test_sparse_tensor_is_sent_dense(torch):
    dense = torch.eye(3)
    assert_same_tensor(torch, roundtrip(dense.to_sparse()), dense)


def test_decoded_tensor_is_writable(torch):
    result = roundtrip(torch.zeros(3))
    result += 1  # no "non-writable" warning (warnings are errors in this suite)
    assert result.tolist() == [1.0, 1.0, 1.0]


def test_meta_tensor_raises_encode_error(torch):
    with pytest.raises(EncodeError):
        packb(torch.zeros(3, device="meta"))


def test_tensors_and_arrays_mix_in_one_message(torch):
    value = [torch.ones(2, dtype=torch.bfloat16), np.ones(2, np.float16), {"t": torch.tensor(True)}]
    result = roundtrip(value)
    assert_same_tensor(torch, result[0], value[0])
    assert_same_array(result[1], value[1])
    assert_same_tensor(torch, result[2]["t"], value[2]["t"])


# --- hostile input -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",  # the one byte msgpack never uses
        b"\x92\x01",  # array of 2 with 1 item
        b"\xa5ab",  # str of 5 with 2 bytes
        b"\xc4\x10abc",  # bin of 16 with 3 bytes
        b"\x81\x01",  # map with a key and no value
        b"\x01\x02",  # two values where one is expected
        b"\xa2\xff\xfe",  # str that is not UTF-8
        b"\x81\x90\x01",  # map with an unhashable (list) key
        b"\x91" * 100_000,  # nesting deeper than the unpacker allows
        b"\xd7\xff" + b"\xff" * 8,  # timestamp ext with nanoseconds out of range
        b"\xc7\x05\xff" + b"\x00" * 5,  # timestamp ext of a wrong length
        bytes(range(256)),
    ],
    ids=repr,
)
def test_garbage_raises_decode_error(data):
    with pytest.raises(DecodeError):
        unpackb(data)


@pytest.mark.parametrize("data", ["text", None, 123, [b"\x01"]], ids=repr)
def test_non_bytes_input_raises_decode_error(data):
    with pytest.raises(DecodeError):
        unpackb(data)


def test_bytearray_and_memoryview_input_is_accepted():
    data = packb({"a": [1, 2]})
    assert unpackb(bytearray(data)) == {"a": [1, 2]}
    assert unpackb(memoryview(data)) == {"a": [1, 2]}


def test_every_truncation_raises_decode_error(torch):
    data = packb({"a": np.arange(6, dtype=np.float32).reshape(2, 3), "t": torch.ones(2), "s": "x"})
    for end in range(len(data)):
        with pytest.raises(DecodeError):
            unpackb(data[:end])


@pytest.mark.parametrize("code", [0, 14, 42, 63, 64, 127])
def test_unknown_ext_code_raises_decode_error(code):
    with pytest.raises(DecodeError, match="unknown extension"):
        unpackb(msgpack.packb(msgpack.ExtType(code, b"\x92\xa3<f4\x91\x01" + b"\x00" * 4)))


@pytest.mark.parametrize("data", [b"\xd4\xfb\x00", b"\xd4\x80\x00", b"\xc7\x00\xfb"], ids=repr)
def test_unknown_negative_ext_code_raises_decode_error(data):
    # msgpack reserves negative codes; only -1 (timestamp) is known to it
    with pytest.raises(DecodeError, match="unknown extension"):
        unpackb(data)


def test_max_bytes_limit():
    data = packb(b"x" * 100)
    assert unpackb(data, max_bytes=len(data)) == b"x" * 100
    with pytest.raises(DecodeError, match="exceeds"):
        unpackb(data, max_bytes=len(data) - 1)


def test_default_max_bytes_limit_is_checked_before_parsing():
    data = b"\x90" + bytes(DEFAULT_MAX_BYTES)  # valid first value, then huge trailing junk
    with pytest.raises(DecodeError, match="exceeds"):
        unpackb(data)


def test_max_bytes_counts_bytes_of_a_multidimensional_memoryview():
    view = memoryview(b"\x90" * 1000).cast("B", (10, 100))
    assert len(view) == 10
    with pytest.raises(DecodeError, match="exceeds"):
        unpackb(view, max_bytes=100)


# Hand-made extension payloads: each one is corrupt or dishonest.
CORRUPT_NDARRAY = {
    "empty-payload": msgpack.packb(msgpack.ExtType(EXT_NDARRAY, b"")),
    "header-truncated": msgpack.packb(msgpack.ExtType(EXT_NDARRAY, b"\x92\xa3<f")),
    "header-not-list": ext(EXT_NDARRAY, "<f4"),
    "header-too-long": ext(EXT_NDARRAY, ["<f4", [1], 0], b"\x00" * 4),
    "header-map": ext(EXT_NDARRAY, {"<f4": 1, "x": 2}, b"\x00" * 4),
    "dtype-not-str": ext(EXT_NDARRAY, [4, [1]], b"\x00" * 4),
    "dtype-bytes": ext(EXT_NDARRAY, [b"<f4", [1]], b"\x00" * 4),
    "dtype-unknown": ext(EXT_NDARRAY, ["zz", [1]], b"\x00" * 4),
    "dtype-structured-list": ext(EXT_NDARRAY, [[["a", "<i4"]], [1]], b"\x00" * 4),
    "dtype-structured-str": ext(EXT_NDARRAY, ["i4,f4", [1]], b"\x00" * 8),
    "dtype-subarray": ext(EXT_NDARRAY, ["(2,)<i4", [1]], b"\x00" * 8),
    "dtype-void-0": ext(EXT_NDARRAY, ["V0", [10**9]]),
    "dtype-stringdtype": ext(EXT_NDARRAY, ["T", [1]], b"\x00" * 16),
    "shape-not-list": ext(EXT_NDARRAY, ["<f4", 1], b"\x00" * 4),
    "shape-negative": ext(EXT_NDARRAY, ["<f4", [-1]], b"\x00" * 8),
    "shape-float": ext(EXT_NDARRAY, ["<f4", [1.0]], b"\x00" * 4),
    "shape-bool": ext(EXT_NDARRAY, ["<f4", [True]], b"\x00" * 4),
    "shape-str": ext(EXT_NDARRAY, ["<f4", ["1"]], b"\x00" * 4),
    "raw-short": ext(EXT_NDARRAY, ["<f4", [3]], b"\x00" * 8),
    "raw-long": ext(EXT_NDARRAY, ["<f4", [1]], b"\x00" * 8),
    "raw-not-multiple": ext(EXT_NDARRAY, ["<f4", [1]], b"\x00" * 5),
    "raw-missing": ext(EXT_NDARRAY, ["<f8", [2, 2]]),
    "bool-not-0-or-1": ext(EXT_NDARRAY, ["|b1", [3]], b"\x00\x01\x02"),
    "too-many-dims": ext(EXT_NDARRAY, ["|u1", [1] * 100], b"\x00"),
    "memory-bomb": ext(EXT_NDARRAY, ["<f8", [10**6, 10**6, 10**6]]),
}

CORRUPT_TENSOR = {
    "empty-payload": msgpack.packb(msgpack.ExtType(EXT_TENSOR, b"")),
    "header-not-list": ext(EXT_TENSOR, "float32"),
    "dtype-not-str": ext(EXT_TENSOR, [None, [1]], b"\x00" * 4),
    "dtype-unknown": ext(EXT_TENSOR, ["float33", [1]], b"\x00" * 4),
    "dtype-prefixed": ext(EXT_TENSOR, ["torch.float32", [1]], b"\x00" * 4),
    "dtype-not-a-dtype": ext(EXT_TENSOR, ["Tensor", [1]], b"\x00" * 4),
    "dtype-function": ext(EXT_TENSOR, ["zeros", [1]], b"\x00" * 4),
    "dtype-dunder": ext(EXT_TENSOR, ["__class__", [1]], b"\x00" * 4),
    "shape-negative": ext(EXT_TENSOR, ["float32", [-1]], b"\x00" * 4),
    "shape-float": ext(EXT_TENSOR, ["float32", [1.5]], b"\x00" * 4),
    "raw-short": ext(EXT_TENSOR, ["float32", [3]], b"\x00" * 8),
    "raw-long": ext(EXT_TENSOR, ["float32", [1]], b"\x00" * 8),
    "raw-not-multiple": ext(EXT_TENSOR, ["float32", [1]], b"\x00" * 5),
    # an empty payload with a non-empty shape used to return uninitialised memory
    "raw-missing": ext(EXT_TENSOR, ["float32", [3]]),
    "bool-not-0-or-1": ext(EXT_TENSOR, ["bool", [2]], b"\x01\x07"),
    "memory-bomb": ext(EXT_TENSOR, ["float64", [10**6, 10**6]]),
}


@pytest.mark.parametrize("data", CORRUPT_NDARRAY.values(), ids=CORRUPT_NDARRAY.keys())
def test_corrupt_ndarray_payload_raises_decode_error(data):
    tracemalloc.start()  # numpy reports its allocations to tracemalloc
    try:
        with pytest.raises(DecodeError):
            unpackb(data)
        with pytest.raises(DecodeError):
            unpackb(msgpack.packb([1, {"x": msgpack.ExtType(EXT_NDARRAY, msgpack.unpackb(data).data)}]))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < MIB, f"refused after allocating {peak} bytes"  # before allocating what the header claims


@pytest.mark.parametrize("data", CORRUPT_TENSOR.values(), ids=CORRUPT_TENSOR.keys())
def test_corrupt_tensor_payload_raises_decode_error(torch, data):
    started = time.perf_counter()
    with pytest.raises(DecodeError):
        unpackb(data)
    # Timing, as torch's allocator is not traced: refused without building the claimed shape.
    assert time.perf_counter() - started < 0.5


def test_tensor_dtype_lookup_does_not_import_torch_submodules(torch):
    # torch's module __getattr__ imports submodules such as torch._dynamo on demand; a dtype
    # name from the broker must not trigger that (slow, with side effects).
    name = "_dynamo"
    already = f"torch.{name}" in sys.modules
    with pytest.raises(DecodeError, match="unknown tensor dtype"):
        unpackb(ext(EXT_TENSOR, [name, [0]]))
    if not already:
        assert f"torch.{name}" not in sys.modules


def test_valid_hand_made_payloads_decode():
    # the wire format, written by hand, as another implementation would
    result = unpackb(ext(EXT_NDARRAY, ["<i2", [2]], b"\x01\x00\xff\xff"))
    assert_same_array(result, np.array([1, -1], dtype="<i2"))
    result = unpackb(ext(EXT_NDARRAY, ["<f4", [0, 7]]))
    assert_same_array(result, np.zeros((0, 7), np.float32))


def test_valid_hand_made_tensor_payload_decodes(torch):
    result = unpackb(ext(EXT_TENSOR, ["int16", [2]], b"\x01\x00\xff\xff"))
    assert_same_tensor(torch, result, torch.tensor([1, -1], dtype=torch.int16))


_UNPICKLED: list[str] = []


def _record(tag: str) -> str:
    _UNPICKLED.append(tag)
    return tag


class _Evil:
    def __reduce__(self):
        return (_record, ("unpickled",))


@pytest.mark.parametrize("dtype", ["O", "|O", "object", "<O", "i4,O", "(2,)O"])
def test_object_dtype_payload_is_refused_and_never_unpickled(monkeypatch, dtype):
    def forbidden(*args, **kwargs):
        raise AssertionError("the codec must never unpickle")

    monkeypatch.setattr(pickle, "loads", forbidden)
    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(pickle, "Unpickler", forbidden)
    _UNPICKLED.clear()
    raw = pickle.dumps(_Evil())
    for shape in ([1], [len(raw) // 8]):
        with pytest.raises(DecodeError):
            unpackb(ext(EXT_NDARRAY, [dtype, shape], raw))
    with pytest.raises(DecodeError):
        unpackb(ext(EXT_NDARRAY, [dtype, [1]], b"\x00" * 8))
    assert _UNPICKLED == []


def test_a_pickle_is_not_a_message():
    _UNPICKLED.clear()
    with pytest.raises(DecodeError):
        unpackb(pickle.dumps(_Evil()))
    with pytest.raises(DecodeError):
        unpackb(pickle.dumps(np.arange(3)))
    assert _UNPICKLED == []


@pytest.mark.parametrize("module", ["core", "arrays", "std"])
def test_codec_has_no_pickle_import(module):
    source = (pathlib.Path(codec.__file__).parent / f"{module}.py").read_text(encoding="utf-8")
    assert "import pickle" not in source
    assert "from pickle" not in source
    assert "allow_pickle" not in source


# --- object budget: memory, not only bytes --------------------------------------------------
# One byte of msgpack can be an empty list or map, about 80 bytes once decoded: a 16 MiB item
# used to become 16.7 M objects and 1.1 GiB. The budget counts one per container and one per item.

MIB = 2**20


def _array(count: int) -> bytes:
    return b"\xdd" + count.to_bytes(4, "big")


def _chunks(element: bytes, total: int, chunk: int) -> bytes:
    """An array of arrays of ``chunk`` copies of ``element``, about ``total`` bytes in all."""
    one = _array(chunk) + element * chunk
    count = (total - 5) // len(one)
    return _array(count) + one * count


def _tuples_of_empty_lists(total: int, chunk: int) -> bytes:
    inner = _array(chunk) + b"\x90" * chunk
    one = b"\xc9" + len(inner).to_bytes(4, "big") + bytes([codec.EXT_TUPLE]) + inner
    count = (total - 5) // len(one)
    return _array(count) + one * count


def test_default_object_budget_follows_max_bytes():
    assert codec.BYTES_PER_OBJECT == 8 and codec.MIN_MAX_OBJECTS == 1024
    data = packb(list(range(100)))  # 101 objects
    assert unpackb(data, max_objects=101) == list(range(100))
    with pytest.raises(DecodeError, match="more than 100 objects"):
        unpackb(data, max_objects=100)
    big = packb([0] * 2000)
    assert unpackb(big, max_bytes=8 * 2001) == [0] * 2000
    with pytest.raises(DecodeError, match="more than 2000 objects"):
        unpackb(big, max_bytes=8 * 2000)


def test_item_of_empty_lists_at_the_workers_size_limit_is_refused_from_its_header():
    # the repro of issue 10 #14: one array of 16 M empty arrays in a 16 MiB item
    count = 16 * MIB - 5
    data = _array(count) + b"\x90" * count
    with pytest.raises(DecodeError, match="more than 2097152 objects"):
        unpackb(data, max_bytes=16 * MIB)


@pytest.mark.parametrize(
    "data",
    [
        _chunks(b"\x90", MIB, 2**16),  # empty lists
        _chunks(b"\x80", MIB, 2**16),  # empty maps
        _chunks(b"\xa2ab", MIB, 2**14),  # two-character strings
        _chunks(_array(1) + b"\x90", MIB, 2**14),  # lists of one empty list
        _tuples_of_empty_lists(MIB, 2**12),  # inside extension values
    ],
    ids=["empty-lists", "empty-maps", "short-strings", "nested-lists", "in-tuples"],
)
def test_decoding_memory_is_bounded_by_the_object_budget(data):
    # 1 MiB of these used to take 70-80 MiB to decode; the budget (max_bytes / 8 objects) stops
    # them at about 10 MiB.
    assert len(data) <= MIB
    tracemalloc.start()
    try:
        with pytest.raises(DecodeError, match="objects"):
            unpackb(data, max_bytes=MIB)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 * MIB, f"decoding took {peak / MIB:.0f} MiB"


def test_a_list_of_floats_up_to_max_bytes_fits_the_default_budget():
    count = (MIB - 5) // 9
    data = packb([0.5] * count)
    assert len(data) <= MIB
    assert unpackb(data, max_bytes=MIB) == [0.5] * count
    assert unpackb(data, max_bytes=MIB, max_objects=count + 1) == [0.5] * count


def test_small_messages_skip_the_counting_hooks(monkeypatch):
    # the hot path: a message that cannot exceed the budget is decoded by msgpack alone
    def forbidden(*args, **kwargs):
        raise AssertionError("counted a small message")

    monkeypatch.setattr(codec, "_counting_options", forbidden)
    assert unpackb(packb({"text": "x" * 1000, "ids": list(range(100)), "pair": (1, 2)})) is not None


# --- properties (hypothesis) ---------------------------------------------------------------

_FAST = settings(
    max_examples=60,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

_json_like = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda children: st.lists(children, max_size=5)
    | st.dictionaries(st.text(max_size=8) | st.integers(-1000, 1000), children, max_size=5),
    max_leaves=12,
)

@_FAST
@given(_json_like)
def test_property_json_like_values_roundtrip(value):
    assert_same(roundtrip(value), value)

@_FAST
@given(
    st.sampled_from(NUMPY_DTYPES),
    st.lists(st.integers(0, 4), max_size=3),
)
def test_property_ndarray_roundtrip(dtype, shape):
    array = (np.arange(math.prod(shape)) % 7).astype(dtype).reshape(shape)
    assert_same_array(roundtrip(array), array)

@_FAST
@given(st.binary(max_size=200))
def test_property_arbitrary_bytes_decode_or_raise_decode_error(data):
    try:
        unpackb(data)
    except DecodeError:
        pass

_VALID = packb([np.arange(6, dtype=np.float32).reshape(2, 3), "s", {1: b"b"}])

@_FAST
@given(st.integers(0, len(_VALID) - 1), st.integers(0, 255))
def test_property_corrupted_message_decodes_or_raises_decode_error(position, byte):
    data = bytearray(_VALID)
    data[position] = byte
    try:
        unpackb(bytes(data))
    except DecodeError:
        pass
