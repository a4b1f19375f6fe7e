"""The wire format between clients and workers: request entries and reply messages.

A request entry holds the caller's reply token (``<client>:<task>``, never a key name), the
item's index in the caller's batch, its absolute deadline (ms since the epoch; a Request holds it in seconds) and the
msgpack payload. A reply message is a msgpack list of ``[index, ok, value_or_error]``.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from . import codec
from .batching import Failure, Outcome
from .errors import DecodeError, EncodeError
from .keys import is_reply_token

TOKEN, INDEX, DEADLINE, PAYLOAD = b"t", b"i", b"d", b"p"


@dataclass(frozen=True)
class Request:
    """One item as a worker sees it."""

    entry_id: bytes
    token: str
    index: int
    deadline: float
    payload: Any


class MalformedEntry(DecodeError):
    """A stream entry that is not a valid request; ``token`` is set when it was readable."""

    def __init__(self, reason: str, token: str | None = None, index: int = 0) -> None:
        super().__init__(reason)
        self.token = token
        self.index = index


def reply_address(fields: Mapping[bytes, bytes] | None) -> tuple[str, int] | None:
    """The ``(token, index)`` an entry's answer goes to, or None when it has no valid one."""
    if not fields:
        return None
    raw_token = fields.get(TOKEN)
    token = raw_token.decode("ascii", "replace") if isinstance(raw_token, bytes) else None
    if token is None or not is_reply_token(token):
        return None
    try:
        return token, int(fields.get(INDEX, b""))
    except ValueError:
        return None


def parse_request(entry_id: bytes, fields: Mapping[bytes, bytes] | None, max_bytes: int) -> Request:
    """Validate and decode one stream entry; raises MalformedEntry."""
    address = reply_address(fields)
    if fields is None or address is None:
        raise MalformedEntry("missing or invalid reply token or index")
    token, index = address
    try:
        deadline_ms = int(fields[DEADLINE])
    except (KeyError, ValueError):
        raise MalformedEntry("missing or invalid deadline", token, index) from None
    if PAYLOAD not in fields:
        raise MalformedEntry("missing payload", token, index)
    try:
        payload = codec.unpackb(fields[PAYLOAD], max_bytes=max_bytes)
    except DecodeError as exc:
        raise MalformedEntry(f"undecodable payload: {exc}", token, index) from None
    return Request(entry_id, token, index, deadline_ms / 1000, payload)


def _result_row(index: int, outcome: Outcome[Any]) -> list[Any]:
    if outcome.ok:
        return [index, True, outcome.value]
    failure = outcome.failure or Failure("Error", "unknown failure")
    return [index, False, [failure.type, failure.message, failure.kind]]


def pack_results(results: Iterable[tuple[int, Outcome[Any]]]) -> bytes:
    """Encode results for one reply key; an output that cannot be encoded fails alone."""
    rows = [_result_row(index, outcome) for index, outcome in results]
    try:
        return codec.packb(rows)
    except EncodeError:
        pass
    safe_rows = []
    for row in rows:
        try:
            codec.packb(row[2])
            safe_rows.append(row)
        except EncodeError as exc:
            safe_rows.append([row[0], False, ["EncodeError", f"model output cannot be sent: {exc}", "remote"]])
    return codec.packb(safe_rows)


def unpack_results(data: bytes, max_bytes: int = codec.DEFAULT_MAX_BYTES) -> list[tuple[int, Outcome[Any]]]:
    """Decode one reply message into ``(index, Outcome)`` pairs."""
    rows = codec.unpackb(data, max_bytes=max_bytes)
    if not isinstance(rows, list):
        raise DecodeError("reply is not a list")
    results = []
    for row in rows:
        if not (isinstance(row, list) and len(row) == 3 and isinstance(row[0], int)):
            raise DecodeError("malformed reply row")
        index, ok, value = row
        if ok:
            results.append((index, Outcome(True, value=value)))
        else:
            if not (isinstance(value, list) and len(value) >= 2):
                raise DecodeError("malformed failure in reply row")
            kind = value[2] if len(value) > 2 else "remote"
            results.append((index, Outcome(False, failure=Failure(str(value[0]), str(value[1]), str(kind)))))
    return results
