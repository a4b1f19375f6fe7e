"""webapp.load's own HTTP client: keep-alive, Content-Length and chunked bodies, closed connections,
several processes, and the CPU line that says when the load generator is the limit."""
from __future__ import annotations

import asyncio
import collections
import json
import threading
import urllib.parse
from collections.abc import Iterator

import pytest

from webapp import load

RESPONSES = {
    "length": b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
    "chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n3\r\n!!!\r\n0\r\n\r\n",
    "close": b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
}


@pytest.fixture
def server() -> Iterator[tuple[str, list[dict]]]:
    """A tiny HTTP/1.1 server on a thread: the input names the response; records each request."""
    seen: list[dict] = []
    loop = asyncio.new_event_loop()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                break
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            body = json.loads(await reader.readexactly(length))
            seen.append({"head": head.decode(), "body": body})
            kind = body["inputs"][0]
            writer.write(RESPONSES[kind])
            await writer.drain()
            if kind == "close":
                break
        writer.close()

    started = threading.Event()
    holder: dict = {}

    def run() -> None:
        asyncio.set_event_loop(loop)
        holder["server"] = loop.run_until_complete(asyncio.start_server(handle, "127.0.0.1", 0))
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    started.wait(5)
    port = holder["server"].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}", seen

    async def shut() -> None:
        holder["server"].close()
        await holder["server"].wait_closed()

    asyncio.run_coroutine_threadsafe(shut(), loop).result(5)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


def test_bodies_of_every_framing_are_read_and_connections_reused(server):
    url, seen = server
    outcome = asyncio.run(load.run_load(url, ["length", "chunked", "close"], requests=9, concurrency=1))
    assert outcome.statuses == {200: 6, 503: 3}
    assert len(outcome.latencies) == 9 and outcome.elapsed > 0 and outcome.cpu >= 0
    assert all(request["head"].startswith("POST /predict HTTP/1.1\r\n") for request in seen)
    assert all("Content-Type: application/json" in request["head"] for request in seen)


def test_form_bodies_and_a_refused_connection(server):
    url, _ = server
    assert load.encode_request("h:1", "/predict", "a b&c", form=True).endswith(b"\r\n\r\ns=a+b%26c")
    outcome = asyncio.run(load.run_load("http://127.0.0.1:1", ["length"], requests=3, concurrency=1))
    assert outcome.statuses == {0: 3}, "no answer is counted, not raised"


def test_processes_share_the_load_and_the_report_names_the_generators_cpu(server):
    url, seen = server
    outcomes = load.run_processes(url, ["length"], requests=10, concurrency=4, processes=2)
    assert len(outcomes) == 2 and sum(o.statuses[200] for o in outcomes) == 10 == len(seen)
    lines = load.report(outcomes, 4)
    assert lines[0].startswith("requests    10 from 4 clients") and lines[0].endswith("10 x 200")
    assert lines[3].startswith("load        2 process(es), the busiest at")
    outcome = load.Outcome(statuses=collections.Counter({200: 1}), latencies=[0.1], elapsed=1.0, cpu=0.95)
    saturated = load.report([outcome], 1)
    assert saturated[-1].startswith("warning     the load generator used a full core")


def test_a_session_returns_each_body_and_reconnects_after_the_server_closed(server):
    url, seen = server
    target = urllib.parse.urlsplit(url)

    async def exchange() -> list[tuple[int, bytes]]:
        session = load.Session(target)
        answers = [await session.send(load.encode_request(target.netloc, "/predict", kind, form=False))
                   for kind in ("length", "chunked", "close", "length")]
        await session.close()
        return answers

    assert asyncio.run(exchange()) == [(200, b"ok"), (200, b"ok!!!"), (503, b""), (200, b"ok")]
    assert len(seen) == 4  # the last one on a new connection: the server had closed the first


def test_a_session_raises_when_no_answer_comes():
    async def refused() -> None:
        await load.Session(urllib.parse.urlsplit("http://127.0.0.1:1")).send(b"GET / HTTP/1.1\r\n\r\n")

    with pytest.raises(load.NO_ANSWER):
        asyncio.run(refused())
