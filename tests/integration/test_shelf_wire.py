"""The shelf's Redis side against a real Redis: the load lease, the holders, the gate's reading, and
a heartbeat process beating in several workers hashes."""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from rstreamer.broker.connection import create_redis
from rstreamer.wire.keys import Keys, ShelfKeys
from rstreamer.wire.published import read_workers
from rstreamer.wire.shelf import (
    drop_lease,
    publish_holdings,
    publish_shelf,
    read_fleet,
    read_serving,
    take_lease,
)
from rstreamer.worker.beater import Beater
from rstreamer.worker.liveness import Heartbeat
from support.keyleaks import leaked_keys
from support.polling import wait_until

DEAD_AFTER_MS = 2000
LEASE_MS = 60_000


@pytest.fixture
def skeys(redis_url: str, prefix: str) -> Iterator[ShelfKeys]:
    keys = ShelfKeys(f"{prefix}-shelf")
    yield keys
    assert not leaked_keys(redis_url, f"shelf:{keys.name}")


@pytest.fixture
def client(redis_url: str) -> Iterator[object]:
    found = create_redis(redis_url)
    yield found
    found.close()


def beat(client: object, key: str, name: str) -> None:
    Heartbeat(client, key, name, lambda: {"pid": 1}, ttl=60).beat()  # type: ignore[arg-type]


def test_one_worker_takes_a_models_load_lease_and_a_live_owner_keeps_it(client, skeys, prefix):
    model = f"{prefix}-m"
    beat(client, skeys.workers, "a")
    beat(client, skeys.workers, "b")
    assert take_lease(client, skeys, model, "a", 0, DEAD_AFTER_MS, LEASE_MS)
    assert not take_lease(client, skeys, model, "b", 0, DEAD_AFTER_MS, LEASE_MS)
    assert take_lease(client, skeys, model, "a", 0, DEAD_AFTER_MS, LEASE_MS)  # its own: taken again
    drop_lease(client, skeys, model, "b")  # not b's: stays
    assert not take_lease(client, skeys, model, "b", 0, DEAD_AFTER_MS, LEASE_MS)
    drop_lease(client, skeys, model, "a")
    assert take_lease(client, skeys, model, "b", 0, DEAD_AFTER_MS, LEASE_MS)
    assert 0 < client.pttl(skeys.lease(model)) <= LEASE_MS


def test_the_lease_of_a_dead_worker_is_taken_over(client, skeys, prefix):
    model = f"{prefix}-m"
    beat(client, skeys.workers, "b")
    assert take_lease(client, skeys, model, "gone", 0, DEAD_AFTER_MS, LEASE_MS)  # "gone" never beat
    assert take_lease(client, skeys, model, "b", 0, DEAD_AFTER_MS, LEASE_MS)


def test_the_lease_is_refused_when_the_holders_changed_since_the_decision(client, skeys, prefix):
    model = f"{prefix}-m"
    for name in ("a", "b"):
        beat(client, skeys.workers, name)
    publish_holdings(client, skeys, "a", {"held": [model], "loading": [], "slots": 1})
    # b decided on evidence that showed no holder: a loaded it meanwhile.
    assert not take_lease(client, skeys, model, "b", 0, DEAD_AFTER_MS, LEASE_MS)
    # A second holder, decided knowing of the first.
    assert take_lease(client, skeys, model, "b", 1, DEAD_AFTER_MS, LEASE_MS)
    drop_lease(client, skeys, model, "b")
    # A holder whose heartbeat lapsed does not count.
    publish_holdings(client, skeys, "dead", {"held": [model], "loading": [], "slots": 1})
    assert take_lease(client, skeys, model, "b", 1, DEAD_AFTER_MS, LEASE_MS)
    state = read_fleet(client, skeys)
    assert state.holders(DEAD_AFTER_MS) == {model: {"a"}}


def test_the_gate_reads_a_live_shelf_worker_as_serving_a_cold_model(client, skeys, prefix):
    cold, other = Keys(f"{prefix}-cold"), Keys(f"{prefix}-other")
    assert read_serving(client, cold)[1] == {}
    publish_shelf(client, skeys, {"name": skeys.name, "models": {cold.prefix: {"model": "a:B"}}})
    assert read_serving(client, cold)[1] == {}  # the shelf is known, but no shelf worker is live
    beat(client, skeys.workers, "shelf-worker")
    now_ms, workers = read_serving(client, cold)
    assert set(workers) == {"shelf-worker"} and workers["shelf-worker"]["shelf"] == skeys.name
    assert now_ms - workers["shelf-worker"]["seen_ms"] < DEAD_AFTER_MS
    assert read_serving(client, other)[1] == {}  # not on the shelf: a misspelt model stays unserved
    beat(client, cold.workers, "shelf-worker")  # once it holds the model, its own beat is the one
    assert "shelf" not in read_serving(client, cold)[1]["shelf-worker"]
    assert 0 < client.ttl(cold.shelf) <= 60


def test_a_heartbeat_process_beats_in_every_hash_named_and_leaves_those_dropped(redis_url, client, prefix):
    first, second = Keys(f"{prefix}-one"), Keys(f"{prefix}-two")
    targets = {first.workers: {"n": 1}}
    beater = Beater(redis_url, "w", lambda: dict(targets), interval=0.1, ttl=30, stuck_after=60)
    beater.start()
    try:
        wait_until(lambda: "w" in read_workers(client, first)[1], 20, what="a beat in the first hash")
        targets[second.workers] = {"n": 2}
        beater.tick(force=True)
        wait_until(lambda: read_workers(client, second)[1].get("w", {}).get("n") == 2, 20,
                   what="a beat in the second hash")
        del targets[first.workers]
        beater.tick(force=True)
        wait_until(lambda: "w" not in read_workers(client, first)[1], 20, what="the first hash left")
        assert "w" in read_workers(client, second)[1]
    finally:
        beater.stop()
    assert "w" not in read_workers(client, second)[1]  # a clean stop leaves every hash
