"""Unit tests of the codec's short paths for arrays (issue 26): an array or a tensor met once is
encoded without the msgpack hook, its payload header is written once per dtype and shape, and a
client splits a header it has just seen without parsing it again. Each path must give the bytes
and values the long one gives, and refuse what it refuses (no Redis)."""
from __future__ import annotations

import msgpack
import numpy as np
import pytest

from rstreamer.codec import arrays
from rstreamer.codec import core as codec
from rstreamer.codec.core import EXT_NDARRAY, EXT_TENSOR, packb, register_type, unpackb
from rstreamer.errors import DecodeError, EncodeError

try:  # imported at collection, so that no single test pays for torch's slow import
    import torch as _torch
except ImportError:  # torch is an optional extra
    _torch = None

ARRAYS = [
    np.zeros(768, np.float32),
    np.arange(12, dtype=">i8").reshape(3, 4),  # big-endian
    np.arange(12, dtype=np.float64).reshape(3, 4).T,  # not C-contiguous
    np.asfortranarray(np.ones((2, 3), np.int16)),
    np.array(7, np.uint8),  # 0-d
    np.zeros((0, 5), np.float32),  # empty
    np.array([True, False]),
    np.array([1 + 2j], np.complex64),
    np.array(["2024-01-01"], "datetime64[ns]"),
    np.array([b"ab", b"c"], "S2"),
]


def _by_hand(array: np.ndarray) -> bytes:
    """The wire form written out from the format's definition: ext 1 around a msgpack
    [dtype.str, shape] header and the C-ordered bytes."""
    data = np.ascontiguousarray(array) if array.ndim else array
    payload = msgpack.packb([data.dtype.str, list(data.shape)]) + data.tobytes()
    return msgpack.packb(msgpack.ExtType(EXT_NDARRAY, payload))


@pytest.mark.parametrize("array", ARRAYS, ids=lambda a: f"{a.dtype.str}{list(a.shape)}")
def test_an_array_is_the_same_bytes_at_the_top_inside_a_list_and_on_every_encoding(array):
    first, again = packb(array), packb(array)  # the second goes the short way
    assert first == again == _by_hand(array)
    assert packb([array, array]) == b"\x92" + _by_hand(array) * 2  # 0x92: an array of two
    decoded = unpackb(again)
    assert type(decoded) is np.ndarray and decoded.dtype == array.dtype and np.array_equal(decoded, array)


def test_a_subclass_of_ndarray_travels_as_an_ndarray_and_is_never_taken_for_the_class_itself(tmp_path):
    mapped = np.memmap(tmp_path / "mapped", dtype=np.int32, mode="w+", shape=(4,))  # numpy's own subclass
    mapped[:] = [1, 2, 3, 4]
    packb(np.zeros(1))  # the plain class is known
    assert packb(mapped) == packb(mapped) == _by_hand(np.asarray(mapped))
    assert np.memmap not in codec._ARRAY_ENCODERS and type(unpackb(packb(mapped))) is np.ndarray


def test_a_dtype_that_cannot_be_sent_is_refused_every_time():
    objects = np.array([object()], dtype=object)
    packb(np.zeros(1))
    for _ in range(2):
        with pytest.raises(EncodeError, match="numpy dtype object cannot be sent"):
            packb(objects)
        with pytest.raises(EncodeError, match="numpy dtype object cannot be sent"):
            packb([objects])


def test_an_application_that_registers_ndarray_itself_comes_first_and_the_codec_takes_it_back_after():
    array = np.arange(3, dtype=np.int64)
    packb(array)
    register_type(np.ndarray, 64, lambda a: a.tolist(), np.array)
    try:
        assert msgpack.unpackb(packb(array)) == msgpack.ExtType(64, msgpack.packb([0, 1, 2]))
        assert packb([array])[1:] == packb(array)
    finally:
        codec._unregister_type(np.ndarray)
    assert packb(array) == _by_hand(array)


@pytest.mark.skipif(_torch is None, reason="torch is an optional extra")
def test_a_tensor_is_the_same_bytes_on_every_encoding_and_a_parameter_is_not_taken_for_a_tensor():
    tensor = _torch.arange(6, dtype=_torch.bfloat16).reshape(2, 3)
    first, again = packb(tensor), packb(tensor)
    assert first == again
    code, payload = msgpack.unpackb(again, ext_hook=lambda c, d: (c, d))
    assert code == EXT_TENSOR and payload == arrays.encode_tensor(tensor)
    assert _torch.equal(unpackb(again), tensor)
    parameter = _torch.nn.Parameter(_torch.ones(2))
    assert _torch.equal(unpackb(packb(parameter)), _torch.ones(2))
    assert type(parameter) not in codec._ARRAY_ENCODERS


def test_a_payload_after_another_shape_or_dtype_decodes_as_its_own():
    for array in [np.zeros(768, np.float32), np.ones((2, 3), np.float32), np.zeros(768, np.float32),
                  np.arange(768, dtype=np.float64), np.zeros(76, np.float32)]:
        decoded = unpackb(packb(array))
        assert decoded.dtype == array.dtype and decoded.shape == array.shape and np.array_equal(decoded, array)


def test_a_hostile_payload_that_starts_with_the_last_header_is_still_checked():
    unpackb(packb(np.zeros(768, np.float32)))  # that header is the last one seen
    header = msgpack.packb(["<f4", [768]])
    short = msgpack.packb(msgpack.ExtType(EXT_NDARRAY, header + b"\0" * 12))
    with pytest.raises(DecodeError, match="needs 3072 bytes, the payload has 12"):
        unpackb(short)
    decoded = unpackb(msgpack.packb(msgpack.ExtType(EXT_NDARRAY, header + b"\0" * 3072)))
    assert decoded.flags.writeable and decoded.shape == (768,)


@pytest.mark.parametrize("name", ["O", "|V4", "not a dtype", "(", "<f4,<i4"])
def test_a_refused_dtype_name_is_refused_every_time(name):
    payload = msgpack.packb(msgpack.ExtType(EXT_NDARRAY, msgpack.packb([name, [1]]) + b"\0" * 8))
    for _ in range(2):
        with pytest.raises(DecodeError):
            unpackb(payload)


def test_decoded_arrays_own_their_memory_whichever_way_their_header_was_split():
    data = packb(np.arange(4, dtype=np.int32))
    first, second = unpackb(data), unpackb(data)
    first[0] = 99
    assert second[0] == 0 and first.flags.writeable and second.flags.writeable
