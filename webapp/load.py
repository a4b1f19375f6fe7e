"""A small load generator for ``POST /predict`` when wrk is not at hand.

    python -m webapp.load --url http://127.0.0.1:8000 --requests 2000 --concurrency 64 [--form]

Each of ``--concurrency`` clients sends one request at a time (a closed loop, like wrk), one
input per request, cycling through ``--text`` lines (default: a few sentences). It prints
the statuses, throughput and latency percentiles, and exits 1 if any request failed.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from rstreamer.metrics import percentile

SENTENCES = (
    "Happy birthday to you.",
    "A man is playing a guitar.",
    "The cat is sleeping on the sofa.",
    "It is going to rain all afternoon, so take an umbrella.",
    "How do I cook pasta?",
    "The flight was delayed by two hours.",
)


async def _client(http: httpx.AsyncClient, texts: Iterator[str], left: list[int], form: bool,
                  statuses: collections.Counter[int], latencies: list[float]) -> None:
    while left[0] > 0:
        left[0] -= 1
        text = next(texts)
        started = time.perf_counter()
        try:
            if form:
                response = await http.post("/predict", data={"s": text})
            else:
                response = await http.post("/predict", json={"inputs": [text]})
            statuses[response.status_code] += 1
        except httpx.HTTPError:
            statuses[0] += 1  # no answer at all: refused, reset or timed out
            continue
        latencies.append(time.perf_counter() - started)


async def run_load(url: str, texts: list[str], requests: int, concurrency: int,
                   form: bool = False) -> tuple[collections.Counter[int], list[float], float]:
    """(count per status, 0 for no answer; latencies of answered requests; elapsed seconds)."""
    statuses: collections.Counter[int] = collections.Counter()
    latencies: list[float] = []
    cycle, left = itertools.cycle(texts), [requests]
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=60.0, limits=limits) as http:
        started = time.perf_counter()
        await asyncio.gather(*(_client(http, cycle, left, form, statuses, latencies) for _ in range(concurrency)))
        return statuses, latencies, time.perf_counter() - started


def _percentile(values: list[float], q: float) -> float:
    value = percentile(values, q)
    return float("nan") if value is None else value * 1000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m webapp.load", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--form", action="store_true", help="send s=... form fields instead of JSON")
    parser.add_argument("--text", type=Path, help="a file with one input per line")
    args = parser.parse_args(argv)
    texts = [line for line in args.text.read_text().splitlines() if line.strip()] if args.text else list(SENTENCES)
    statuses, latencies, elapsed = asyncio.run(run_load(args.url, texts, args.requests, args.concurrency, args.form))
    print(f"requests    {sum(statuses.values())} from {args.concurrency} clients in {elapsed:.1f}s: "
          + ", ".join(f"{count} x {status or 'no answer'}" for status, count in sorted(statuses.items())))
    print(f"throughput  {statuses[200] / elapsed:,.1f} requests/s")
    print(f"latency     p50 {_percentile(latencies, 0.5):.1f} ms, p99 {_percentile(latencies, 0.99):.1f} ms")
    return 0 if set(statuses) == {200} else 1


if __name__ == "__main__":
    sys.exit(main())
