"""AsyncRedisStreamer against a real redis-server and real worker processes."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
import redis

from rstreamer import (
    AsyncRedisStreamer,
    BrokerUnavailable,
    Overloaded,
    RedisStreamer,
    RemoteError,
    StreamerTimeout,
)
from rstreamer.client import aio_coalescer
from rstreamer.codec import unpackb
from rstreamer_tools.sentences import SENTENCES, TRIPLES, cosine
from support.polling import async_wait_until
from support.stalls import async_stalled_blpop


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, timeout=50))


def test_round_trip_and_future_api(redis_url, prefix, workers):
    workers.start(prefix)

    async def scenario():
        async with AsyncRedisStreamer(redis_url, prefix) as streamer:
            outputs = await streamer.predict([3, 1.5, "ab", b"ab", [1, 2], np.arange(3, dtype=np.int32)])
            future = await streamer.submit([5, 6])
            assert await future == [10, 12]
            assert await future.result(timeout=1) == [10, 12] and future.done()
            futures = [await streamer.submit([i]) for i in range(50)]
            assert [await f.result(timeout=10) for f in futures] == [[2 * i] for i in range(50)]
            assert await streamer.predict([]) == []
            return outputs

    outputs = run(scenario())
    assert outputs[:5] == [6, 3.0, "abab", b"abab", [1, 2, 1, 2]]
    assert outputs[5].dtype == np.int32 and outputs[5].tolist() == [0, 2, 4]


def test_many_concurrent_calls_each_get_their_own_answer(redis_url, prefix, workers):
    workers.start(prefix, batch_size=32, max_latency=0.01)
    workers.start(prefix, batch_size=32, max_latency=0.01)

    async def scenario():
        async with AsyncRedisStreamer(redis_url, prefix) as streamer:
            return await asyncio.gather(*(streamer.predict([n, n + 0.5]) for n in range(800)))

    assert run(scenario()) == [[2 * n, 2 * n + 1.0] for n in range(800)]


def test_sync_and_async_clients_share_one_endpoint(redis_url, prefix, workers):
    workers.start(prefix)

    async def scenario():
        async with AsyncRedisStreamer(redis_url, prefix) as streamer:
            return await streamer.predict(["a"])

    with RedisStreamer(redis_url, prefix) as sync_streamer:
        assert sync_streamer.predict(["s"]) == ["ss"]
    assert run(scenario()) == ["aa"]


def test_model_error_fails_only_its_item(redis_url, prefix, workers):
    workers.start(prefix)

    async def scenario():
        async with AsyncRedisStreamer(redis_url, prefix) as streamer:
            bad, good = await asyncio.gather(streamer.predict([1, "boom"]), streamer.predict([2]),
                                             return_exceptions=True)
            return bad, good

    bad, good = run(scenario())
    assert isinstance(bad, RemoteError)
    assert (bad.remote_type, bad.remote_message, bad.http_status) == ("ValueError", "boom is not a number", 500)
    assert good == [4]


def test_no_worker_times_out_and_withdraws_its_entries(redis_client, redis_url, prefix):
    async def scenario():
        async with AsyncRedisStreamer(redis_url, prefix, timeout=0.3) as streamer:
            with pytest.raises(StreamerTimeout, match="0.3s timeout"):
                await streamer.predict([1])
            future = await streamer.submit([2], timeout=5)
            with pytest.raises(StreamerTimeout, match="not answered yet"):
                await future.result(timeout=0.05)
            return streamer.keys.requests

    requests = run(scenario())
    # The timed-out call withdrew its entry (no worker runs: no reply key is ever written; the
    # next test proves that a caller deletes one that was). The live call may stay queued.
    assert [unpackb(fields[b"p"]) for _, fields in redis_client.xrange(requests)] in ([], [2])


def test_a_caller_that_times_out_deletes_its_reply_key(redis_client, redis_url, prefix, workers, monkeypatch):
    # The worker answers, but the caller's pops stall (a fault injected in its connection) until
    # its deadline: the answer is in the reply key when the caller gives up, and must go with it.
    workers.start(prefix)

    async def scenario():
        async with AsyncRedisStreamer(redis_url, prefix) as streamer:
            monkeypatch.setattr(aio_coalescer, "async_direct_command", async_stalled_blpop)
            future = await streamer.submit([1], timeout=1.5)
            await async_wait_until(lambda: redis_client.exists(future.call.reply_key),
                                   what="the worker's answer in the reply key")
            with pytest.raises(StreamerTimeout):
                await future.result()
            # the call's task deletes it once it stops popping, just after the future timed out
            await async_wait_until(lambda: not redis_client.exists(future.call.reply_key), timeout=5,
                                   what="the caller to delete its reply key")

    run(asyncio.wait_for(scenario(), 30))


def test_calls_after_redis_forgot_its_scripts_are_enqueued(redis_client, redis_url, prefix, workers):
    # The ENQUEUE goes out as a bare EVALSHA: after SCRIPT FLUSH (or a restart) the streamer
    # loads the script again and runs it, once.
    workers.start(prefix)

    async def scenario():
        async with AsyncRedisStreamer(redis_url, prefix, timeout=10) as streamer:
            assert await streamer.predict([1]) == [2]
            for n in range(3):
                redis_client.script_flush()
                assert await asyncio.gather(streamer.predict([n]), streamer.predict([n + 1])) == [[2 * n], [2 * n + 2]]

    run(asyncio.wait_for(scenario(), 30))


def test_full_queue_is_overloaded(redis_url, prefix):
    async def scenario():
        async with AsyncRedisStreamer(redis_url, prefix, max_queue=1, timeout=5) as streamer:
            await streamer.submit([1])
            with pytest.raises(Overloaded) as raised:
                await streamer.submit([2])
            return raised.value

    assert run(scenario()).http_status == 503


def test_calls_past_max_connections_are_overloaded(redis_client, redis_url, prefix):
    async def scenario():
        async with AsyncRedisStreamer(redis_url, prefix, timeout=10, max_connections=1) as streamer:
            waiting = asyncio.ensure_future(streamer.predict([1]))
            # The first call holds the only connection once it blocks in BLPOP.
            await async_wait_until(lambda: _blpop_clients(redis_client), what="the first call in BLPOP")
            with pytest.raises(Overloaded, match="too many calls in flight"):
                await streamer.predict([2])
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting

    run(scenario())


def _blpop_clients(client: redis.Redis) -> int:
    return sum(1 for c in client.client_list() if c.get("cmd") == "blpop")


def test_redis_down_is_broker_unavailable_then_recovers(redis_server, redis_url, prefix, workers):
    workers.start(prefix)

    async def scenario():
        async with AsyncRedisStreamer(redis_url, prefix, timeout=5) as streamer:
            assert await streamer.predict([1]) == [2]
            redis_server.stop()
            try:
                with pytest.raises(BrokerUnavailable) as raised:
                    await streamer.predict([2])
                assert raised.value.http_status == 503
            finally:
                redis_server.start()
            deadline = asyncio.get_running_loop().time() + 30
            while asyncio.get_running_loop().time() < deadline:  # the worker reconnects with backoff
                try:
                    return await streamer.predict([3], timeout=1)
                except (StreamerTimeout, BrokerUnavailable):
                    continue
            return "the service did not resume within 30 s"

    assert run(scenario()) == [6]


def test_embeddings_have_meaning(redis_url, prefix, workers):
    workers.start(prefix, model="workers.embedding:EmbeddingModel", init_kwargs={"torch_threads": 1},
                  batch_size=32, max_latency=0.01)
    sentences = list(SENTENCES)

    async def scenario():
        async with AsyncRedisStreamer(redis_url, prefix) as streamer:
            return await asyncio.gather(*(streamer.predict([s]) for s in sentences))

    vectors = {s: out[0] for s, out in zip(sentences, run(scenario()), strict=True)}
    for anchor, paraphrase, unrelated in TRIPLES:
        close, far = cosine(vectors[anchor], vectors[paraphrase]), cosine(vectors[anchor], vectors[unrelated])
        assert close > far + 0.1, (anchor, close, far)
