"""Reading, replaying and purging a prefix's dead letters.

A dead letter (written by the worker) holds the original entry id, the reason, the worker's
name and a copy of every field of the original entry under ``f_<field>``. Replaying one puts
those fields back on the request stream with a fresh deadline (the old one has passed: the
worker would only answer it as expired) and deletes the letter, in one MULTI so that a letter is
never both replayed and kept, or deleted and not replayed. Its caller has usually given up: the
answer goes to a reply key with a TTL, so nothing leaks.
"""
from __future__ import annotations

import reprlib
from dataclasses import dataclass
from typing import Any, cast

from redis.typing import EncodableT, FieldT

from ..broker.connection import RedisClient, StreamRows
from ..codec import core as codec
from ..errors import DecodeError
from ..settings import check_timeout
from ..wire.keys import Keys
from ..wire.messages import DEADLINE, PAYLOAD, REMAINING

FIELD_PREFIX = b"f_"
PREVIEW_BYTES = 64 * 1024
_preview = reprlib.Repr()
_preview.maxstring = 80
_preview.maxother = 80
_preview.maxlist = _preview.maxdict = _preview.maxtuple = 8


@dataclass(frozen=True)
class DeadLetter:
    """One record of the dead-letter stream, as shown to an operator."""

    id: str
    at_ms: int
    entry: str
    reason: str
    worker: str
    preview: str
    deliveries: int = 0  # 0: not recorded (a letter of an older worker)


def read_dead_letters(client: RedisClient, keys: Keys, count: int = 50) -> list[DeadLetter]:
    """The newest ``count`` dead letters, newest first."""
    rows = cast(StreamRows, client.xrevrange(keys.dead, count=count))
    return [_letter(letter_id, fields) for letter_id, fields in rows]


def _letter(letter_id: bytes, fields: dict[bytes, bytes]) -> DeadLetter:
    text = letter_id.decode()
    return DeadLetter(text, int(text.split("-")[0]), _text(fields.get(b"entry")), _text(fields.get(b"reason")),
                      _text(fields.get(b"worker")), payload_preview(fields.get(FIELD_PREFIX + PAYLOAD)),
                      _deliveries(fields))


def _deliveries(fields: dict[bytes, bytes]) -> int:
    try:
        return int(fields.get(b"deliveries") or 0)
    except ValueError:
        return 0


def read_dead_letter(client: RedisClient, keys: Keys, letter_id: str) -> tuple[DeadLetter, dict[str, str]] | None:
    """One dead letter and every field of its original entry (payload rendered as a preview), or None."""
    found: Any = client.xrange(keys.dead, letter_id, letter_id, count=1)
    if not found:
        return None
    (raw_id, fields), = found
    entry = {}
    for name, value in fields.items():
        if name.startswith(FIELD_PREFIX):
            field = name[len(FIELD_PREFIX):].decode("utf-8", "replace")
            entry[field] = payload_preview(value) if name == FIELD_PREFIX + PAYLOAD else _text(value)
    return _letter(raw_id, fields), entry


def _text(value: bytes | None) -> str:
    return value.decode("utf-8", "replace") if value is not None else ""


def payload_preview(raw: bytes | None) -> str:
    """A short, safe rendering of an entry's payload (decoded with msgpack only, never pickle)."""
    if raw is None:
        return "(no payload)"
    try:
        return _preview.repr(codec.unpackb(raw, max_bytes=PREVIEW_BYTES))
    except DecodeError:
        return f"(undecodable, {len(raw)} bytes: {raw[:24].hex()})"


def replay(client: RedisClient, keys: Keys, letter_ids: list[str], timeout: float = 60.0) -> int:
    """Put dead letters back on the request stream of their priority level with ``timeout``
    seconds to run (at most MAX_TIMEOUT, a day; ConfigError otherwise); returns how many."""
    timeout = check_timeout(timeout)
    letters = [(i, f) for i in letter_ids for _, f in cast(StreamRows, client.xrange(keys.dead, i, i, count=1))]
    if not letters:
        return 0
    seconds, micros = client.time()  # a version-1 deadline, on Redis's clock like the callers'
    deadline = str(int(seconds) * 1000 + int(micros) // 1000 + int(timeout * 1000)).encode()
    pipe = client.pipeline(transaction=True)
    for letter_id, fields in letters:
        entry: dict[FieldT, EncodableT] = {
            k[len(FIELD_PREFIX):]: v for k, v in fields.items() if k.startswith(FIELD_PREFIX)}
        # version 2 counts ``r`` from the new entry's id; version 1 reads ``d``
        entry[REMAINING], entry[DEADLINE] = str(int(timeout * 1000)).encode(), deadline
        pipe.xadd(keys.requests_at(_level(fields)), entry)
        pipe.xdel(keys.dead, letter_id)
    pipe.execute()
    return len(letters)


def _level(fields: dict[bytes, bytes]) -> int:
    """The priority level a letter was read from (the worker records it when not 0)."""
    try:
        return max(0, int(fields.get(b"level", b"0")))
    except ValueError:
        return 0


def purge(client: RedisClient, keys: Keys, letter_ids: list[str]) -> int:
    """Delete dead letters; returns how many existed."""
    return int(client.xdel(keys.dead, *letter_ids)) if letter_ids else 0


def as_json(letter: DeadLetter) -> dict[str, Any]:
    """A letter as a JSON object."""
    return dict(letter.__dict__)
