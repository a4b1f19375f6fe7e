"""The non-blocking, script-free Redis paths against fakeredis: key layout, status and dead letters.

Fast unit tests without a server. Everything that blocks (XREADGROUP BLOCK, BLPOP) or runs a
Lua script is tested against a real redis-server under tests/integration/.
"""
from __future__ import annotations

from collections.abc import Iterator

import fakeredis
import pytest

from rstreamer.codec import core as codec
from rstreamer.ops import deadletters, status
from rstreamer.ops.deadletters import FIELD_PREFIX
from rstreamer.wire.keys import Keys
from rstreamer.wire.messages import DEADLINE, PAYLOAD, REMAINING


@pytest.fixture
def client() -> Iterator[fakeredis.FakeRedis]:
    server = fakeredis.FakeServer()  # a private one: fakeredis shares a default server otherwise
    client = fakeredis.FakeRedis(server=server)
    yield client
    client.close()


def test_every_key_of_a_prefix_is_under_its_hash_tag(client):
    keys = Keys("model.v2")
    client.xadd(keys.requests, {b"p": b"x"})
    client.xadd(keys.dead, {b"reason": b"r"})
    client.hset(keys.workers, "w", "{}")
    client.rpush(keys.reply("c1:7"), b"answer")
    assert {key.decode() for key in client.scan_iter()} == {
        "rstreamer:{model.v2}:requests", "rstreamer:{model.v2}:dead", "rstreamer:{model.v2}:workers",
        "rstreamer:{model.v2}:reply:c1:7",
    }


def test_list_prefixes_finds_the_request_streams_only(client):
    for prefix in ("b.c", "a"):
        client.xadd(Keys(prefix).requests, {b"p": b"x"})
    client.xadd(Keys("only-dead").dead, {b"reason": b"r"})
    client.set("rstreamer:unrelated", b"1")
    assert status.list_prefixes(client) == ["a", "b.c"]


def test_oldest_waiting_is_the_first_entry_not_yet_delivered(client):
    keys = Keys("p")
    assert status.oldest_waiting_ms(client, keys) is None  # no stream yet
    client.xgroup_create(keys.requests, keys.group, id="0", mkstream=True)
    assert status.oldest_waiting_ms(client, keys) is None  # nothing waits
    client.xadd(keys.requests, {b"p": b"1"}, id="1000-0")
    client.xadd(keys.requests, {b"p": b"2"}, id="2000-0")
    assert status.oldest_waiting_ms(client, keys) == 1000
    client.xreadgroup(keys.group, "w", {keys.requests: ">"}, count=1)  # delivered, not yet acked
    assert status.oldest_waiting_ms(client, keys) == 2000
    client.xreadgroup(keys.group, "w", {keys.requests: ">"}, count=1)
    assert status.oldest_waiting_ms(client, keys) is None


def _dead_letter(client, keys: Keys, payload: object) -> str:
    fields = {b"entry": b"5-0", b"reason": b"delivered 3 times", b"worker": b"host:1:ab",
              FIELD_PREFIX + PAYLOAD: codec.packb(payload), FIELD_PREFIX + DEADLINE: b"1", b"token": b"c:1"}
    return client.xadd(keys.dead, fields, id="7000-0").decode()


def test_a_dead_letter_reads_back_with_a_safe_preview(client):
    keys = Keys("p")
    letter_id = _dead_letter(client, keys, {"text": "hello"})
    (letter,) = deadletters.read_dead_letters(client, keys)
    assert (letter.id, letter.at_ms, letter.entry, letter.reason, letter.worker) == (
        letter_id, 7000, "5-0", "delivered 3 times", "host:1:ab")
    assert letter.preview == "{'text': 'hello'}"


def test_replay_puts_the_entry_back_with_a_fresh_deadline_and_removes_the_letter(client):
    keys = Keys("p")
    letter_id = _dead_letter(client, keys, [1, 2])
    assert deadletters.replay(client, keys, [letter_id, "9-9"], timeout=5.0) == 1  # 9-9: not a letter
    assert client.xlen(keys.dead) == 0
    ((_, entry),) = client.xrange(keys.requests)
    assert codec.unpackb(entry[PAYLOAD]) == [1, 2]
    assert entry[REMAINING] == b"5000"
    assert int(entry[DEADLINE]) > 1  # on the server's clock now, not the dead entry's
    assert b"reason" not in entry and b"token" not in entry  # only the original entry's fields


def test_purge_deletes_the_named_letters_and_counts_them(client):
    keys = Keys("p")
    letter_id = _dead_letter(client, keys, None)
    assert deadletters.purge(client, keys, []) == 0
    assert deadletters.purge(client, keys, [letter_id, "9-9"]) == 1
    assert client.xlen(keys.dead) == 0
