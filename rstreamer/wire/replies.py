"""Client-side decoding of reply messages, so that one bad answer costs only its own caller.

With coalescing one reply message carries the answers of several callers. A message that
fails to decode as a whole (one output too big for the decode limit, a map key msgpack cannot
rebuild) is split into its rows and each row is decoded alone: a row that fails becomes a
failure of that item only. Only a message whose rows cannot even be told apart fails as a
whole (UndecodableReply), and then the caller fails every call that waits on that reply key.
"""
from __future__ import annotations

from typing import Any

import msgpack

from ..batching.batcher import Failure, Outcome
from ..codec import core as codec
from ..errors import DecodeError, FailureKind, RemoteError
from .messages import unpack_results

Results = list[tuple[int, Outcome[Any]]]


class UndecodableReply(DecodeError):
    """A reply message whose rows cannot be told apart."""


def decode_reply(data: bytes, max_bytes: int = codec.DEFAULT_MAX_BYTES) -> Results:
    """The ``(index, Outcome)`` pairs of one reply message; a row that cannot be decoded fails alone.

    Raises UndecodableReply when the message is not a list of rows at all.
    """
    try:
        return unpack_results(data, max_bytes)  # the usual case: one pass
    except DecodeError:
        pass
    results: Results = []
    for row in _split_rows(data):
        results.append(_decode_row(row, max_bytes))
    return results


def undecodable(exc: BaseException) -> RemoteError:
    """The error each caller of an unreadable reply message gets (a 500: the worker sent it)."""
    return RemoteError("DecodeError", f"the reply could not be decoded: {exc}")


def _split_rows(data: bytes) -> list[memoryview]:
    """The encoded rows of a reply message, undecoded (skip() builds no object)."""
    view = memoryview(data)
    unpacker = msgpack.Unpacker(max_buffer_size=max(len(view), 1))
    unpacker.feed(view)
    try:
        count = unpacker.read_array_header()
        rows, start = [], unpacker.tell()
        for _ in range(count):
            unpacker.skip()
            rows.append(view[start:unpacker.tell()])
            start = unpacker.tell()
    except (ValueError, msgpack.UnpackException, msgpack.OutOfData) as exc:
        raise UndecodableReply(f"reply is not a list of rows: {exc}") from exc
    return rows


def _decode_row(row: memoryview, max_bytes: int) -> tuple[int, Outcome[Any]]:
    try:
        (result,) = unpack_results(b"\x91" + row.tobytes(), max_bytes)  # a one-row list
        return result
    except DecodeError as exc:
        return _row_index(row), Outcome(False, failure=Failure("DecodeError", f"the answer could not be "
                                                                             f"decoded: {exc}", FailureKind.REMOTE))


def _row_index(row: memoryview) -> int:
    """The index of a row whose value cannot be decoded (read without decoding the value)."""
    unpacker = msgpack.Unpacker(max_buffer_size=max(len(row), 1))
    unpacker.feed(row)
    try:
        if unpacker.read_array_header() == 3:
            index = unpacker.unpack()
            if isinstance(index, int) and not isinstance(index, bool):
                return index
    except (ValueError, msgpack.UnpackException, msgpack.OutOfData):
        pass
    raise UndecodableReply("a reply row has no readable index")
