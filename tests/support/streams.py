"""Streams in flight while a test kills their worker: one caller thread per item, all mid-answer."""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

from rstreamer.broker.connection import create_redis
from rstreamer.wire.keys import Keys
from rstreamer.wire.published import read_workers


@contextlib.contextmanager
def streams_mid_answer(stream: Callable[[Any], Iterator[Any]], items: list[Any], first_chunk_wait: float,
                       join_wait: float) -> Iterator[tuple[dict[int, list[Any]], list[BaseException]]]:
    """Stream each of ``items`` in a thread of its own (``stream(item)`` gives its chunks) and enter
    once every stream has its first chunk: they are all mid-answer. Gives the chunks each caller
    received (by index) and the errors raised; on exit, waits up to ``join_wait`` s for each caller
    to finish."""
    results: dict[int, list[Any]] = {}
    errors: list[BaseException] = []
    started = threading.Barrier(len(items) + 1)

    def call(n: int) -> None:
        chunks: list[Any] = []
        try:
            chunks_of = stream(items[n])
            chunks.append(next(chunks_of))
            started.wait(first_chunk_wait)
            chunks.extend(chunks_of)
        except BaseException as exc:
            errors.append(exc)
            started.abort()
        results[n] = chunks

    threads = [threading.Thread(target=call, args=(n,)) for n in range(len(items))]
    for thread in threads:
        thread.start()
    try:
        started.wait(first_chunk_wait)
        yield results, errors
    finally:
        for thread in threads:
            thread.join(join_wait)


def reclaimed(url: str, prefix: str) -> int:
    """How many items the workers of ``prefix`` have reclaimed from dead ones (their heartbeats' count)."""
    client = create_redis(url)
    try:
        _, workers = read_workers(client, Keys(prefix))
    finally:
        client.close()
    return sum(int(info.get("reclaimed", 0)) for info in workers.values())
