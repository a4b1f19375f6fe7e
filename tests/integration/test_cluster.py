"""The Redis transport on a real 3-master Redis Cluster: core, reliability, status, sharding by prefix."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.cluster import RedisCluster

from rstreamer import AsyncRedisStreamer, InvalidPriority, RedisStreamer
from rstreamer.broker.connection import create_redis
from rstreamer.wire.keys import Keys
from support import procs
from support.cluster import LocalCluster
from support.procs import ROOT, WorkerProcesses, wait_until
from support.web import WebServers

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    """Three masters on free ports; at the end, no key but a stream may lack a TTL on any node."""
    local = LocalCluster(masters=3).start()
    try:
        yield local
        leaked = [key for port in local.ports for key in _keys_without_ttl(local, port)]
        assert not leaked, f"keys left without a TTL: {leaked[:20]}"
    finally:
        local.close()


def _keys_without_ttl(cluster: LocalCluster, port: int) -> list[str]:
    node = cluster.node_client(port)
    try:
        return [key.decode() for key in node.scan_iter(count=1000)
                if node.type(key) != b"stream" and node.ttl(key) == -1]
    finally:
        node.close()


@pytest.fixture
def client(cluster: LocalCluster) -> Iterator[RedisCluster]:
    cluster_client = create_redis(cluster.url)
    assert isinstance(cluster_client, RedisCluster)
    yield cluster_client
    cluster_client.close()


@pytest.fixture
def cluster_workers(cluster: LocalCluster) -> Iterator[WorkerProcesses]:
    factory = WorkerProcesses(cluster.url)
    yield factory
    factory.stop_all()


def owner_port(client: RedisCluster, key: str) -> int:
    """The port of the master that holds ``key``'s slot."""
    return int(client.nodes_manager.get_node_from_slot(client.keyslot(key)).port)


def prefixes_one_per_master(client: RedisCluster, masters: int) -> dict[int, str]:
    """A prefix on each master: {port: prefix}."""
    found: dict[int, str] = {}
    for n in range(10_000):
        prefix = f"shard-{os.getpid()}-{n}"
        found.setdefault(owner_port(client, Keys(prefix).requests), prefix)
        if len(found) == masters:
            return found
    raise AssertionError("no prefix found for some master")


def test_round_trip_through_the_cluster(cluster, client, prefix, cluster_workers):
    cluster_workers.start(prefix)
    with RedisStreamer(cluster.url, prefix) as streamer:
        assert isinstance(streamer.redis, RedisCluster)
        outputs = streamer.predict([3, 1.5, "ab", b"ab", [1, 2], np.arange(3, dtype=np.float16)])
        assert streamer.predict([]) == []
    assert outputs[:5] == [6, 3.0, "abab", b"abab", [1, 2, 1, 2]]
    assert outputs[5].dtype == np.float16 and outputs[5].tolist() == [0.0, 2.0, 4.0]
    assert client.xlen(Keys(prefix).requests) == 0, "answered entries are XDELed by the worker's MULTI"


def test_async_streamer_through_the_cluster(cluster, prefix, cluster_workers):
    cluster_workers.start(prefix)

    async def calls() -> list[list[int]]:
        async with AsyncRedisStreamer(cluster.url, prefix) as streamer:
            assert isinstance(streamer.redis, AsyncRedisCluster)
            return list(await asyncio.gather(*(streamer.predict([n, n + 1]) for n in range(20))))

    assert asyncio.run(calls()) == [[2 * n, 2 * n + 2] for n in range(20)]


def test_concurrent_calls_each_get_their_own_answer(cluster, prefix, cluster_workers):
    cluster_workers.start(prefix, batch_size=32, max_latency=0.01)
    cluster_workers.start(prefix, batch_size=32, max_latency=0.01)
    wrong = []
    with RedisStreamer(cluster.url, prefix) as streamer:
        def call(n: int) -> None:
            result = streamer.predict([n, n + 0.5])
            if result != [2 * n, 2 * n + 1.0]:
                wrong.append((n, result))

        with ThreadPoolExecutor(max_workers=16) as pool:
            list(pool.map(call, range(800)))
    assert not wrong


def test_sigkilled_worker_s_items_are_reclaimed_by_another(cluster, client, prefix, cluster_workers):
    keys = Keys(prefix)
    victim = cluster_workers.start(prefix, init_kwargs={"delay": 60})
    with RedisStreamer(cluster.url, prefix) as streamer:
        future = streamer.submit([1, 2, 3])
        wait_until(lambda: client.xpending(keys.requests, keys.group)["pending"] == 3, timeout=10,
                   what="the victim to hold the items")
        os.killpg(victim.pid, signal.SIGKILL)
        assert victim.wait(timeout=10) == -signal.SIGKILL
        cluster_workers.start(prefix)
        assert future.result(timeout=30) == [2, 4, 6]
    wait_until(lambda: client.xpending(keys.requests, keys.group)["pending"] == 0, timeout=10,
               what="the reclaimed entries to be acked")


def test_status_reads_every_shard(cluster, client, cluster_workers):
    shards = prefixes_one_per_master(client, 3)
    for prefix in shards.values():
        cluster_workers.start(prefix)
        with RedisStreamer(cluster.url, prefix) as streamer:
            assert streamer.predict([1, 2]) == [2, 4]
    def status_once_counted() -> dict | None:  # heartbeats carry the items counted so far
        one = json.loads(run_status(cluster.url, "--prefix", shards[cluster.ports[0]], "--interval", "0"))
        return one if one["workers"] and one["workers"][0]["items"] == 2 else None

    one = wait_until(status_once_counted, timeout=30, what="the worker's 2 items in status")
    assert one["queue_length"] == 0 and one["pending"] == 0 and one["dead_letters"] == 0
    assert len(one["workers"]) == 1
    listed = {row["prefix"]: row for row in json.loads(run_status(cluster.url))["prefixes"]}
    assert set(shards.values()) <= set(listed), "a prefix on some shard is missing from the listing"
    assert all(listed[prefix]["live_workers"] == 1 for prefix in shards.values())


def run_status(url: str, *args: str) -> str:
    command = [sys.executable, "-c", "import sys; from rstreamer.cli import main; sys.exit(main())",
               "status", "--redis", url, "--json", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=30, env=procs.test_env(), cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_web_apps_serve_and_report_ready_from_the_cluster(cluster, prefix, cluster_workers):
    cluster_workers.start(prefix)
    web = WebServers(cluster.url)  # gunicorn and uvicorn processes, with the cluster's URL
    try:
        flask = web.gunicorn(prefix, RSTREAMER_TIMEOUT="10")
        assert flask.client.get("/readyz").status_code == 200
        assert flask.predict([1, 2]).json() == {"outputs": [2, 4]}
        starlette = web.uvicorn(prefix, RSTREAMER_TIMEOUT="10")
        assert starlette.client.get("/readyz").status_code == 200
        assert starlette.predict([3]).json() == {"outputs": [6]}
    finally:
        web.stop_all()


def test_prefixes_spread_over_shards_and_each_stays_on_one_slot(cluster, client, cluster_workers):
    shards = prefixes_one_per_master(client, 3)
    assert sorted(shards) == sorted(cluster.ports), "each master owns some prefix"
    for prefix in shards.values():
        cluster_workers.start(prefix, wait=False)
    for port, prefix in shards.items():
        with RedisStreamer(cluster.url, prefix) as streamer:
            assert streamer.predict([port]) == [2 * port]
    for port, prefix in shards.items():
        keys = Keys(prefix)
        slot = client.keyslot(keys.requests)
        # The worker's MULTI touches the stream, the dead letters and reply keys: one slot.
        assert {client.keyslot(k) for k in (keys.workers, keys.dead, keys.reply("c0ffee:7"))} == {slot}
        node = cluster.node_client(port)
        try:
            on_node = {k.decode() for k in node.scan_iter(match=f"rstreamer:{{{prefix}}}:*")}
        finally:
            node.close()
        assert {keys.requests, keys.workers} <= on_node, f"{prefix} is not on its master {port}"


def test_priority_levels_live_on_their_prefix_s_slot_and_are_reclaimed(cluster, client, prefix, cluster_workers):
    keys = Keys(prefix)
    levels = {"priorities": "4,1"}
    assert {client.keyslot(k) for k in (keys.requests_at(1), keys.requests_at(2), keys.levels)} == {
        client.keyslot(keys.requests)}
    victim = cluster_workers.start(prefix, init_kwargs={"delay": 60}, settings=levels)
    with RedisStreamer(cluster.url, prefix, timeout=40) as streamer:
        with pytest.raises(InvalidPriority):
            streamer.predict([1], priority=2)
        future = streamer.submit([1, 2, 3], priority=1)
        wait_until(lambda: client.xpending(keys.requests_at(1), keys.group)["pending"] == 3, timeout=10,
                   what="the victim to hold the level-1 items")
        os.killpg(victim.pid, signal.SIGKILL)
        assert victim.wait(timeout=10) == -signal.SIGKILL
        cluster_workers.start(prefix, settings=levels)
        assert future.result(timeout=30) == [2, 4, 6]
        assert streamer.predict([4]) == [8] and streamer.predict([5], priority=1) == [10]
    wait_until(lambda: client.xpending(keys.requests_at(1), keys.group)["pending"] == 0, timeout=10,
               what="the reclaimed level-1 entries to be acked")
    levels_row = json.loads(run_status(cluster.url, "--prefix", prefix, "--interval", "0"))["levels"]
    assert [(row["level"], row["weight"]) for row in levels_row] == [(0, 4), (1, 1)]


def test_fair_sharing_between_tenants_works_on_a_cluster(cluster, client, prefix, cluster_workers):
    keys = Keys(prefix)
    assert {client.keyslot(k) for level in (0, 1) for k in keys.level_keys(level)} == {client.keyslot(keys.requests)}
    cluster_workers.start(prefix, settings={"priorities": "4,1", "tenant_sharing": "fair"})
    with RedisStreamer(cluster.url, prefix, timeout=40) as streamer:
        wait_until(lambda: streamer.levels().fair, timeout=30, what="the workers to publish fair levels")
        futures = [streamer.submit([n, n + 1], priority=n % 2, tenant=f"t{n % 3}") for n in range(12)]
        assert [f.result(timeout=30) for f in futures] == [[2 * n, 2 * n + 2] for n in range(12)]
    assert not client.exists(*keys.level_keys(0)[1:], *keys.level_keys(1)[1:]), "nothing left held"
