"""A load generator for ``POST /predict`` that measures the server, not itself.

    python -m webapp.load --url http://127.0.0.1:8000 --requests 2000 --concurrency 64 [--form]

Each of ``--concurrency`` clients keeps one HTTP/1.1 keep-alive connection and sends one request
at a time (a closed loop, like wrk), one input per request, cycling through ``--text`` lines
(default: a few sentences). The clients are spread over ``--processes`` processes, each an
asyncio loop writing requests and reading responses on raw sockets: an HTTP library's client
(httpx, aiohttp) costs several times more CPU per request, and one such process saturated its
core and reported about 9 times less than wrk. Each process measures its own CPU use; when one
is near a full core, the result says that the load generator, not the server, may be the limit.

It prints the statuses, throughput and latency percentiles, and exits 1 if any request failed.
wrk (``webapp/benchmark.lua``, docs/webapp.md) remains the reference where it is installed.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import json
import os
import sys
import time
import urllib.parse
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from rstreamer.ops.metrics import percentile

SENTENCES = (
    "Happy birthday to you.",
    "A man is playing a guitar.",
    "The cat is sleeping on the sofa.",
    "It is going to rain all afternoon, so take an umbrella.",
    "How do I cook pasta?",
    "The flight was delayed by two hours.",
)
# A process using this share of one core or more is probably what limits the measured rate.
SATURATED = 0.9


@dataclass
class Outcome:
    """What one process measured: count per status (0: no answer), latencies, wall and CPU seconds."""

    statuses: collections.Counter[int] = field(default_factory=collections.Counter)
    latencies: list[float] = field(default_factory=list)
    elapsed: float = 0.0
    cpu: float = 0.0


def encode_request(host: str, path: str, text: str, form: bool) -> bytes:
    """One keep-alive ``POST`` with one input, JSON or service-streamer's form field."""
    if form:
        body, content_type = urllib.parse.urlencode({"s": text}).encode(), "application/x-www-form-urlencoded"
    else:
        body, content_type = json.dumps({"inputs": [text]}).encode(), "application/json"
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


async def read_response(reader: asyncio.StreamReader) -> tuple[int, bool, bytes]:
    """(status, keep-alive, body) of the next response."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers = {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines[1:])}
    if headers.get("transfer-encoding", "").lower() == "chunked":
        chunks = []
        while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
            chunks.append((await reader.readexactly(size + 2))[:-2])
        await reader.readuntil(b"\r\n")
        body = b"".join(chunks)
    else:
        body = await reader.readexactly(int(headers.get("content-length", "0")))
    return status, headers.get("connection", "").lower() != "close", body


NO_ANSWER = (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError, ValueError)
"""What :meth:`Session.send` raises when a request got no answer: refused, reset, timed out or garbled."""


class Session:
    """One client's keep-alive HTTP/1.1 connection to ``url``: opened on first use, and again
    after the server closed it or a request failed (which raises one of NO_ANSWER)."""

    def __init__(self, url: urllib.parse.SplitResult, timeout: float = 60.0) -> None:
        self.url = url
        self.timeout = timeout
        self._connection: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def send(self, request: bytes) -> tuple[int, bytes]:
        """Send one encoded request (:func:`encode_request`); its response's status and body."""
        try:
            if self._connection is None:
                self._connection = await asyncio.open_connection(self.url.hostname, self.url.port or 80)
            reader, writer = self._connection
            writer.write(request)
            status, keep_alive, body = await asyncio.wait_for(read_response(reader), self.timeout)
        except NO_ANSWER:
            await self.close()
            raise
        if not keep_alive:
            await self.close()
        return status, body

    async def close(self) -> None:
        """Close the connection, if one is open."""
        connection, self._connection = self._connection, None
        if connection is not None:
            connection[1].close()
            try:
                await connection[1].wait_closed()
            except OSError:
                pass  # reset by the server: closed all the same


async def _client(url: urllib.parse.SplitResult, requests: list[bytes], left: list[int], outcome: Outcome) -> None:
    session = Session(url)
    cycle = itertools.cycle(requests)
    while left[0] > 0:
        left[0] -= 1
        started = time.perf_counter()
        try:
            status, _ = await session.send(next(cycle))
        except NO_ANSWER:
            outcome.statuses[0] += 1  # no answer at all: refused, reset or timed out
            continue
        outcome.statuses[status] += 1
        outcome.latencies.append(time.perf_counter() - started)
    await session.close()


async def run_load(url: str, texts: list[str], requests: int, concurrency: int, form: bool = False) -> Outcome:
    """Send ``requests`` requests from ``concurrency`` connections of this process."""
    target = urllib.parse.urlsplit(url)
    host = target.netloc
    path = (target.path.rstrip("/") or "") + "/predict"
    encoded = [encode_request(host, path, text, form) for text in texts]
    outcome, left = Outcome(), [requests]
    cpu, started = time.process_time(), time.perf_counter()
    await asyncio.gather(*(_client(target, encoded, left, outcome) for _ in range(concurrency)))
    outcome.elapsed, outcome.cpu = time.perf_counter() - started, time.process_time() - cpu
    return outcome


def _process_main(url: str, texts: list[str], requests: int, concurrency: int, form: bool) -> Outcome:
    return asyncio.run(run_load(url, texts, requests, concurrency, form))


def run_processes(url: str, texts: list[str], requests: int, concurrency: int, processes: int,
                  form: bool = False) -> list[Outcome]:
    """Split the requests and connections over ``processes`` processes; one Outcome each."""
    processes = max(1, min(processes, concurrency, requests))
    if processes == 1:
        return [_process_main(url, texts, requests, concurrency, form)]
    shares = [(requests // processes + (i < requests % processes), concurrency // processes
               + (i < concurrency % processes)) for i in range(processes)]
    with ProcessPoolExecutor(processes) as pool:
        futures = [pool.submit(_process_main, url, texts, n, c, form) for n, c in shares]
        return [future.result() for future in futures]


def _percentile(values: list[float], q: float) -> float:
    value = percentile(values, q)
    return float("nan") if value is None else value * 1000


def report(outcomes: list[Outcome], concurrency: int) -> list[str]:
    """The summary lines: statuses, throughput, latency, and the load generator's own CPU use."""
    statuses: collections.Counter[int] = sum((o.statuses for o in outcomes), collections.Counter())
    latencies = [latency for o in outcomes for latency in o.latencies]
    elapsed = max(o.elapsed for o in outcomes)
    busiest = max(o.cpu / o.elapsed for o in outcomes if o.elapsed > 0) if elapsed > 0 else 0.0
    lines = [
        f"requests    {sum(statuses.values())} from {concurrency} clients in {elapsed:.1f}s: "
        + ", ".join(f"{count} x {status or 'no answer'}" for status, count in sorted(statuses.items())),
        f"throughput  {statuses[200] / elapsed:,.1f} requests/s",
        f"latency     p50 {_percentile(latencies, 0.5):.1f} ms, p99 {_percentile(latencies, 0.99):.1f} ms",
        f"load        {len(outcomes)} process(es), the busiest at {busiest:.0%} of a core",
    ]
    if busiest >= SATURATED:
        lines.append("warning     the load generator used a full core: it may limit the rate measured; "
                     "add --processes (if cores are free) or use wrk")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m webapp.load", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--processes", type=int, default=min(2, os.cpu_count() or 1),
                        help="load-generating processes (default: 2, or 1 on one core)")
    parser.add_argument("--form", action="store_true", help="send s=... form fields instead of JSON")
    parser.add_argument("--text", type=Path, help="a file with one input per line")
    args = parser.parse_args(argv)
    if min(args.requests, args.concurrency, args.processes) < 1:
        parser.error("--requests, --concurrency and --processes must be >= 1")
    texts = [line for line in args.text.read_text().splitlines() if line.strip()] if args.text else list(SENTENCES)
    outcomes = run_processes(args.url, texts, args.requests, args.concurrency, args.processes, args.form)
    print("\n".join(report(outcomes, args.concurrency)))
    return 0 if {status for o in outcomes for status in o.statuses} == {200} else 1


if __name__ == "__main__":
    sys.exit(main())
