"""The wire format between clients and workers: request entries, admission and reply messages.

Every entry and every reply carries a wire version. A worker reads entries of the current
version and of the previous one and answers each in the version it came in; a client reads
replies of both. An entry of an unknown version is answered with a clear error.

Request entry, version 2 (stream fields)::

    v  b"2"
    t  reply token ``<client>:<task>``, or ``job:<id>`` for an item of a job (never a key name)
    i  index of the item in the caller's batch
    r  the call's remaining timeout in ms when it was enqueued; the deadline is the entry id's
       ms (the Redis server's clock at XADD) plus ``r``, so no host clock is ever compared
    d  the same deadline on the client's wall clock (epoch ms), read only by version-1 workers
    p  the item, msgpack

and optionally ``tp`` (the caller's W3C traceparent, rstreamer.ops.tracing) and ``h`` (``1``: the
item was held by fair sharing and moved to the stream, wire/lua/include/fair.lua; a worker that
reads one checks the batch for withdrawals before predict). Fields a worker does not know are
ignored.

Version 1 (rstreamer before the wire version) has no ``v`` and no ``r``: ``d`` is the deadline.

Reply message, version 2: a msgpack map ``{"v": 2, "r": rows}`` whose rows are ``[index, True,
bin]`` (``bin``: the output, msgpack-encoded on its own, so that a client that cannot decode
one output fails only that item) or ``[index, False, [type, message, kind]]``. Version 1: the
bare list of rows with the outputs inline. The worker checks that each output decodes within
the client's limits and splits replies so that no message exceeds them.
"""
from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from ..batching.batcher import Failure, Outcome
from ..codec import core as codec
from ..errors import CallTooLarge, DecodeError, EncodeError, FailureKind, InvalidPriority, Overloaded, RateLimited
from .keys import Keys, is_answer_token

WIRE_VERSION = 2
PREVIOUS_VERSION = 1
VERSION, TOKEN, INDEX, REMAINING, DEADLINE, PAYLOAD = b"v", b"t", b"i", b"r", b"d", b"p"
ROWS = "r"

ADMIT_WAIT_FRACTION = 0.5
"""A call is refused at once when the oldest undelivered item of its prefix has waited more than
this fraction of the call's timeout: a new item would wait about as long, and then run."""

REPLY_GRACE = 1.0
"""Seconds a reply outlives its caller's deadline (the caller's own clock started a bit earlier)."""

MAX_DURATION_MS = 366 * 24 * 3600 * 1000
"""The longest duration, in ms, that any Lua script accepts (remaining timeouts, TTLs;
lua/include/checks.lua checks the same number before it writes anything), and so the longest a
reply key lives (:func:`reply_ttl_ms`). It exceeds the clients' limits (settings.MAX_TIMEOUT,
settings.MAX_JOB_TTL), so no client of this version ever meets it, and it keeps every number a
script computes an integer Redis accepts."""

_ENVELOPE = 1024  # bytes a reply message may need beyond its outputs (headers, indexes, errors)

MAX_INDEX = 2**32 - 1
"""The largest item index an entry may carry (a batch is far smaller; a larger one could not be
answered: msgpack and the Lua scripts stop at 64 bits)."""
MAX_WIRE_MS = 2**53
"""The largest time in ms (remaining timeout, version-1 deadline) an entry may carry: exact as
a float, and a reply TTL derived from it stays within what PEXPIRE accepts."""


# Not frozen: one is built per item on the hot path, and a frozen dataclass's __init__ costs
# four times a plain one's (issue 26). Treat it as immutable all the same.
@dataclass(slots=True)
class Request:
    """One item as a worker sees it; ``deadline`` is in seconds on the Redis server's clock."""

    entry_id: bytes
    token: str
    index: int
    deadline: float
    payload: Any
    version: int = WIRE_VERSION


class MalformedEntry(DecodeError):
    """A stream entry that is not a valid request; ``token`` is set when it was readable."""

    def __init__(self, reason: str, token: str | None = None, index: int = 0, version: int = WIRE_VERSION) -> None:
        super().__init__(reason)
        self.token = token
        self.index = index
        self.version = version


def reply_address(fields: Mapping[bytes, bytes] | None) -> tuple[str, int] | None:
    """The ``(token, index)`` an entry's answer goes to, or None when it has no valid one."""
    if not fields:
        return None
    raw_token = fields.get(TOKEN)
    token = raw_token.decode("ascii", "replace") if isinstance(raw_token, bytes) else None
    if token is None or not is_answer_token(token):
        return None
    try:
        index = int(fields.get(INDEX, b""))
    except ValueError:
        return None
    return (token, index) if 0 <= index <= MAX_INDEX else None


def entry_version(fields: Mapping[bytes, bytes] | None) -> int | None:
    """The wire version of an entry: 1 without a ``v`` field, None when ``v`` is not a number."""
    raw = (fields or {}).get(VERSION)
    if raw is None:
        return PREVIOUS_VERSION
    try:
        return int(raw)
    except ValueError:
        return None


def reply_version(fields: Mapping[bytes, bytes] | None) -> int:
    """The version to answer an entry in: its own when this worker speaks it, else the current one."""
    version = entry_version(fields)
    return version if version in (PREVIOUS_VERSION, WIRE_VERSION) else WIRE_VERSION


def entry_time(entry_id: bytes) -> float:
    """The Redis server's time (s) when the entry was added: the ms part of its id."""
    return int(entry_id.split(b"-", 1)[0]) / 1000


def parse_request(
    entry_id: bytes, fields: Mapping[bytes, bytes] | None, max_bytes: int, wall_to_server: float = 0.0
) -> Request:
    """Validate and decode one stream entry; raises MalformedEntry.

    ``wall_to_server`` (s) turns this host's wall clock into Redis's; it is used only for a
    version-1 entry, whose deadline is on the client's wall clock (assumed to be this host's).
    """
    address = reply_address(fields)
    if fields is None or address is None:
        raise MalformedEntry("missing or invalid reply token or index")
    token, index = address
    version = entry_version(fields)
    if version not in (PREVIOUS_VERSION, WIRE_VERSION):
        raise MalformedEntry(
            f"wire version {fields[VERSION]!r} is not spoken by this worker (versions {PREVIOUS_VERSION}-"
            f"{WIRE_VERSION}): upgrade the workers before the web fleet", token, index)
    try:
        if version == WIRE_VERSION:
            deadline = entry_time(entry_id) + _wire_ms(fields[REMAINING]) / 1000
        else:
            deadline = _wire_ms(fields[DEADLINE]) / 1000 + wall_to_server
    except (KeyError, ValueError):
        raise MalformedEntry("missing or invalid deadline", token, index, version) from None
    if PAYLOAD not in fields:
        raise MalformedEntry("missing payload", token, index, version)
    try:
        payload = codec.unpackb(fields[PAYLOAD], max_bytes=max_bytes)
    except DecodeError as exc:
        raise MalformedEntry(f"undecodable payload: {exc}", token, index, version) from None
    return Request(entry_id, token, index, deadline, payload, version)


def _wire_ms(raw: bytes) -> int:
    """A time in ms from an entry; ValueError unless it is an integer in 0..MAX_WIRE_MS (a huge
    one would overflow the deadline's float or the reply's PEXPIRE)."""
    value = int(raw)
    if not 0 <= value <= MAX_WIRE_MS:
        raise ValueError(f"{value} ms is out of range")
    return value


# admission (the ENQUEUE_CALLS script) ------------------------------------------------------

@dataclass(frozen=True)
class QueueLimits:
    """What the ENQUEUE_CALLS script checks before it adds a call (0 disables a bound)."""

    max_queue: int
    max_queue_bytes: int
    group: str


LEVELS_UNKNOWN = "?"
"""What ENQUEUE_CALLS gets for the published levels when the client holds no copy: it reads them."""


def enqueue_args(limits: QueueLimits, token: str, calls: Sequence[tuple[Sequence[bytes], float, int, str | None]],
                 now: float, traceparents: Sequence[bytes] = (), levels: bytes | None = None) -> list[Any]:
    """ARGV of ENQUEUE_CALLS for ``calls`` of one token, each ``(payloads, deadline, priority,
    tenant)`` (tenant None: no quota).

    ``levels``: the client's fresh copy of the published levels (the key's value, ``b""`` when
    none is published; see :class:`rstreamer.wire.published.LevelsCopy`), or None for none:
    the script reads the key.

    ``traceparents`` (optional, one per call, ``b""`` for none) follow the payloads; each
    call's entries then carry it in the optional field ``tp`` (rstreamer.ops.tracing).

    ``deadline`` and ``now`` are on this host's wall clock; the entries carry the remaining
    timeout, which the workers count from the entry id (Redis's clock). ``priority`` is the
    level whose stream the call's entries go to (KEYS: see :func:`enqueue_keys`).
    """
    tenants = call_tenants(calls)
    shapes: list[Any] = []
    payloads: list[bytes] = []
    for call_payloads, deadline, priority, tenant in calls:
        number = tenants.index(tenant) + 1 if tenant is not None else 0
        shapes += [len(call_payloads), max(0, int((deadline - now) * 1000)), int(deadline * 1000), priority, number]
        payloads += call_payloads
    return [limits.max_queue, limits.max_queue_bytes, int(ADMIT_WAIT_FRACTION * 1000), limits.group,
            token, WIRE_VERSION, len(calls), len(tenants), LEVELS_UNKNOWN if levels is None else levels,
            *tenants, *shapes, *payloads,
            *(traceparents if any(traceparents) else ())]


def call_tenants(calls: Sequence[tuple[Any, ...]]) -> list[str]:
    """The distinct tenants of ``calls`` (their last field), in order of first appearance."""
    return list(dict.fromkeys(call[-1] for call in calls if call[-1] is not None))


def enqueue_keys(keys: Keys, priorities: Iterable[int], tenants: Sequence[str] = ()) -> list[str]:
    """KEYS of ENQUEUE_CALLS: the published levels and quotas, the buckets of ``tenants`` (see
    :func:`call_tenants`), then the keys of levels 0 up to the highest of ``priorities`` (the
    script counts the more urgent levels' backlog too; :meth:`Keys.level_keys`)."""
    return [keys.levels, keys.quotas, *(keys.bucket(tenant) for tenant in tenants),
            *(key for level in range(max(priorities, default=0) + 1) for key in keys.level_keys(level))]


@dataclass(frozen=True)
class Verdict:
    """The ENQUEUE_CALLS script's verdict on one call: ``reason`` 0 when it was added, else why
    not, with a detail and the limit it hit (see wire/lua/enqueue_calls.lua)."""

    reason: int = 0
    detail: int = 0
    limit: int = 0

    @property
    def added(self) -> bool:
        """Whether the call was added to its stream."""
        return self.reason == 0

    def error(self, prefix: str, limits: QueueLimits, priority: int = 0,
              tenant: str | None = None) -> Overloaded | InvalidPriority | RateLimited | CallTooLarge:
        """The error of a refused call (``priority``, ``tenant``: the call's). A call larger than
        its tenant's burst can never fit, however long it waits: CallTooLarge (413), not
        RateLimited (429, which invites a retry; issue 22, friction 10)."""
        if self.reason == 5:
            if self.detail < 0:
                return CallTooLarge(f"a call of tenant {tenant!r} is larger than its burst of {self.limit} items "
                                    f"on prefix {prefix!r}: split it into calls of at most {self.limit} items")
            return RateLimited(f"tenant {tenant!r} is over its quota on prefix {prefix!r} (burst {self.limit} "
                               f"items); retry in {self.detail / 1000:.3f}s", retry_after=self.detail / 1000)
        if self.reason == 4:
            return InvalidPriority(
                f"priority {priority} is not served on prefix {prefix!r}: its workers serve levels 0-"
                f"{self.detail - 1} (set --priorities on the workers; 0 is the most urgent)")
        levels = f" at priorities 0-{priority}" if priority else ""
        level = f" at priority {priority}" if priority else ""
        why = {
            1: f"{self.detail} items wait undelivered{levels} (max_queue={self.limit or limits.max_queue})",
            2: f"its request streams hold {self.detail} bytes (max_queue_bytes={limits.max_queue_bytes})",
            3: (f"the oldest waiting item{level} has waited "
                f"{self.detail / 1000:.1f}s, so this call would not finish within its timeout"),
        }.get(self.reason, "the queue is full")
        return Overloaded(f"prefix {prefix!r} is overloaded: {why}")


ADDED = Verdict()  # the verdict of a call that was added
_ADDED_TRIPLE = (0, 0, 0)


@dataclass(frozen=True)
class Admission:
    """The ENQUEUE_CALLS reply: one verdict per call, and the ids of the entries added (in order)."""

    verdicts: tuple[Verdict, ...]
    ids: tuple[bytes, ...] = ()

    @classmethod
    def parse(cls, reply: Sequence[Any]) -> Admission:
        """The ENQUEUE script's reply: the number of calls, a (reason, detail, limit) triple per
        call, then the ids of the entries added."""
        calls = int(reply[0])
        numbers = [int(value) for value in reply[1:1 + 3 * calls]]
        # Most calls are added: they share one verdict (a frozen dataclass each cost a call of a
        # coalesced ENQUEUE 0.4 us; issue 26).
        verdicts = tuple(ADDED if triple == _ADDED_TRIPLE else Verdict(*triple)
                         for triple in zip(numbers[0::3], numbers[1::3], numbers[2::3], strict=True))
        return cls(verdicts, tuple(reply[1 + 3 * calls:]))


# replies --------------------------------------------------------------------------------

def _failure_row(index: int, failure: Failure) -> list[Any]:
    return [index, False, [failure.type, failure.message, failure.kind.value]]


def _encoded_output(value: Any, max_bytes: int, version: int = WIRE_VERSION) -> bytes | Failure:
    """``value`` encoded, or why a client could not receive it: it must decode within the limits.
    A client of the previous version gets the previous encoding (see codec.packb_legacy)."""
    try:
        data = codec.packb_legacy(value) if version == PREVIOUS_VERSION else codec.packb(value)
    except EncodeError as exc:
        return Failure("EncodeError", f"model output cannot be sent: {exc}")
    if len(data) <= max_bytes and version != PREVIOUS_VERSION and _numeric_array(value):
        # The codec wrote it whole (a dtype it accepts, its exact bytes): it decodes whenever it
        # fits the limit, so decoding it to check costs time and nothing else (a 768-float
        # vector: 3 of 6.6 us on a 2-vCPU VM, per item of every batch; issue 26).
        return data
    try:
        codec.unpackb(data, max_bytes=max_bytes)
    except DecodeError as exc:
        return Failure("EncodeError", f"model output would not decode on the client: {exc}")
    return data


def _numeric_array(value: Any) -> bool:
    """A numpy array (ints, floats, complex) or torch tensor (ints, floats) itself, no subclass,
    that holds items: nothing in its bytes can fail the client's decoding. Booleans can (bytes
    other than 0 and 1), and so can an empty tensor of a huge shape (torch overflows its strides)."""
    cls = type(value)
    if cls.__name__ == "ndarray" and cls.__module__ == "numpy":
        return value.dtype.kind in "iufc" and value.size > 0
    if cls.__name__ == "Tensor" and cls.__module__ == "torch":
        return (bool(value.dtype.is_floating_point) or str(value.dtype) in _TORCH_INTEGERS) and value.numel() > 0
    return False


_TORCH_INTEGERS = frozenset({"torch.int8", "torch.uint8", "torch.int16", "torch.int32", "torch.int64"})


def _bin_header(size: int) -> bytes:
    """The msgpack header of a bin of ``size`` bytes (msgpack-python has no packer for it alone)."""
    if size < 1 << 8:
        return bytes((0xC4, size))
    if size < 1 << 16:
        return b"\xc5" + struct.pack(">H", size)
    return b"\xc6" + struct.pack(">I", size)


def _row_bytes(index: int, outcome: Outcome[Any], version: int, max_bytes: int) -> bytes:
    """One reply row, msgpack-encoded."""
    if outcome.ok:
        output = _encoded_output(outcome.value, max_bytes - _ENVELOPE, version)
        if isinstance(output, bytes):
            # A small index is its own msgpack (a positive fixint), and True is 0xc3: msgpack.packb
            # builds a Packer per call, twice per item a worker answers (issue 26).
            head = (bytes((index,)) if 0 <= index < 0x80 else codec.packb(index)) + b"\xc3"
            if version != PREVIOUS_VERSION:
                head += _bin_header(len(output))
            return b"\x93" + head + output  # 0x93: an array of three
        failure = output
    else:
        failure = outcome.failure or Failure("Error", "unknown failure")
    return codec.packb(_failure_row(index, failure))


def _message(rows: list[bytes], version: int) -> bytes:
    packer = msgpack.Packer()
    body: bytes = packer.pack_array_header(len(rows)) + b"".join(rows)
    if version == PREVIOUS_VERSION:
        return body
    header: bytes = packer.pack_map_header(2) + packer.pack("v") + packer.pack(version) + packer.pack(ROWS)
    return header + body


def pack_results(results: Iterable[tuple[int, Outcome[Any]]], version: int = WIRE_VERSION,
                 max_bytes: int = codec.DEFAULT_MAX_BYTES) -> list[bytes]:
    """Reply messages for one reply key, in ``version``.

    An output that cannot be encoded, or that the client could not decode within ``max_bytes``
    (its decode limit), fails alone; rows are split over several messages so that none
    exceeds ``max_bytes``.
    """
    messages: list[bytes] = []
    rows: list[bytes] = []
    size = _ENVELOPE
    for index, outcome in results:
        row = _row_bytes(index, outcome, version, max_bytes)
        if rows and size + len(row) > max_bytes:
            messages.append(_message(rows, version))
            rows, size = [], _ENVELOPE
        rows.append(row)
        size += len(row)
    if rows:
        messages.append(_message(rows, version))
    return messages


def reply_ttl_ms(floor: float, deadlines: Iterable[float], now: float) -> int:
    """How long a reply key lives: until its last caller's deadline has passed, at least ``floor``
    s, at most MAX_DURATION_MS and at least 1 ms (what the FINISH script accepts: a batch whose TTL it
    refused would be served again and refused again, for ever)."""
    latest = max(deadlines, default=now)
    return max(1, min(MAX_DURATION_MS, int(max(floor, latest - now + REPLY_GRACE) * 1000)))


def _decode_output(item: Any, version: int, max_bytes: int) -> Outcome[Any]:
    if version == PREVIOUS_VERSION:
        return Outcome(True, value=item)
    if not isinstance(item, bytes):
        raise DecodeError("malformed output in reply row")
    try:
        return Outcome(True, value=codec.unpackb(item, max_bytes=max_bytes))
    except DecodeError as exc:
        return Outcome(False, failure=Failure("DecodeError", f"the output cannot be decoded: {exc}"))


def _reply_rows(message: Any) -> tuple[int, list[Any]]:
    """The version and rows of a decoded reply message."""
    if isinstance(message, list):
        return PREVIOUS_VERSION, message
    if not isinstance(message, dict):
        raise DecodeError("reply is not a list or a map")
    version = message.get("v")
    if version not in (PREVIOUS_VERSION, WIRE_VERSION):
        raise DecodeError(f"reply of wire version {version!r}; this client reads versions "
                          f"{PREVIOUS_VERSION}-{WIRE_VERSION}: upgrade the web fleet")
    rows = message.get(ROWS)
    if not isinstance(rows, list):
        raise DecodeError("reply has no rows")
    return version, rows


def _failure_of(value: Any) -> Outcome[Any]:
    if not (isinstance(value, list) and len(value) >= 2):
        raise DecodeError("malformed failure in reply row")
    kind = FailureKind.from_wire(value[2]) if len(value) > 2 else FailureKind.REMOTE
    return Outcome(False, failure=Failure(str(value[0]), str(value[1]), kind))


def unpack_results(data: bytes, max_bytes: int = codec.DEFAULT_MAX_BYTES) -> list[tuple[int, Outcome[Any]]]:
    """Decode one reply message (version 1 or 2) into ``(index, Outcome)`` pairs.

    In a version-2 reply, an output that cannot be decoded fails only its own item.
    """
    version, rows = _reply_rows(codec.unpackb(data, max_bytes=max_bytes))
    results = []
    for row in rows:
        if not (isinstance(row, list) and len(row) == 3 and isinstance(row[0], int)):
            raise DecodeError("malformed reply row")
        index, ok, value = row
        results.append((index, _decode_output(value, version, max_bytes) if ok else _failure_of(value)))
    return results
