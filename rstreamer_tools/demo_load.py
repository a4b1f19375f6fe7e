"""The load of `rstreamer demo`: phases of more and more concurrent HTTP clients, then many
callers through the Python client; what the workers batched meanwhile, the summary that
explains it and the plot that shows it."""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import textwrap
import threading
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

import redis

from rstreamer.ops import metrics
from rstreamer.wire.keys import Keys
from rstreamer.wire.published import fleet_totals
from rstreamer_tools.sentences import SENTENCES, TRIPLES, cosine
from webapp.load import Session, encode_request

# The load ------------------------------------------------------------------------------------


@dataclass
class Sample:
    """One HTTP request of the load."""

    sentence: str
    started: float  # seconds since the load started
    latency: float
    status: int
    vector: list[float] | None


@dataclass(frozen=True)
class Phase:
    """``clients`` concurrent clients ``via`` HTTP or the Python client, from ``start`` to ``end``
    (seconds since the load started)."""

    clients: int
    via: str
    start: float
    end: float


HTTP = "HTTP"
CLIENT = "client"


async def _http_loop(url: urllib.parse.SplitResult, sentences: Iterator[str], samples: list[Sample], t0: float,
                     until: float) -> None:
    # A client sends one sentence, waits for its answer, sends the next: it has one request in
    # flight, on a keep-alive connection of its own. Written on the socket (webapp.load's Session),
    # not with httpx: httpx's pool took this process's whole core at 128 clients and answered 77
    # requests/s where the server answered 534, so the phase measured the load generator.
    session = Session(url)
    path = url.path.rstrip("/") + "/predict"
    try:
        while time.perf_counter() < until:
            sentence = next(sentences)
            started = time.perf_counter()
            try:
                status, body = await session.send(encode_request(url.netloc, path, sentence, form=False))
                vector = json.loads(body)["outputs"][0] if status == 200 else None
            except Exception:  # a failed request is counted as an error; the load goes on
                status, vector = 0, None
            samples.append(Sample(sentence, started - t0, time.perf_counter() - started, status, vector))
    finally:
        await session.close()


async def _caller_loop(streamer: Any, sentences: Iterator[str], samples: list[Sample], t0: float,
                       until: float) -> None:
    # The same, through AsyncRedisStreamer: what one call of a web process puts on the queue.
    while time.perf_counter() < until:
        sentence = next(sentences)
        started = time.perf_counter()
        try:
            vector: list[float] | None = (await streamer.predict([sentence]))[0]
            status = 200
        except Exception:  # RStreamerError: counted as an error; the load goes on
            status, vector = 0, None
        samples.append(Sample(sentence, started - t0, time.perf_counter() - started, status, vector))


@dataclass
class Load:
    """Phases of ``seconds`` each: HTTP clients (``phases``), then ``callers`` Python-client callers."""

    base_url: str
    redis_url: str
    prefix: str
    phases: list[int]
    callers: int
    seconds: float
    samples: list[Sample] = field(default_factory=list)
    done: list[Phase] = field(default_factory=list)
    _sentences: Iterator[str] = field(default_factory=lambda: itertools.cycle(SENTENCES))

    async def run(self) -> tuple[list[Sample], list[Phase]]:
        """Run every phase, one after the other."""
        from rstreamer import AsyncRedisStreamer

        t0 = time.perf_counter()
        url = urllib.parse.urlsplit(self.base_url)
        for clients in self.phases:
            await self._phase(t0, clients, HTTP,
                              lambda until: _http_loop(url, self._sentences, self.samples, t0, until))
        if self.callers:
            async with AsyncRedisStreamer(self.redis_url, self.prefix) as streamer:
                await self._phase(t0, self.callers, CLIENT, lambda until: _caller_loop(
                    streamer, self._sentences, self.samples, t0, until))
        return self.samples, self.done

    async def _phase(self, t0: float, clients: int, via: str, loop: Callable[[float], Awaitable[None]]) -> None:
        start = time.perf_counter()
        until = start + self.seconds
        # return_exceptions: a stop (the task cancelled) ends the phase once every client has
        # closed its connection; without it, gather ends at the first client that ends cancelled,
        # and the loop was closed under the others (tracebacks at Ctrl-C).
        for outcome in await asyncio.gather(*(loop(until) for _ in range(clients)), return_exceptions=True):
            if isinstance(outcome, BaseException):
                raise outcome
        self.done.append(Phase(clients, via, start - t0, time.perf_counter() - t0))


def embed_all(base_url: str) -> dict[str, list[float]]:
    """Every sentence of the meaning check in one call: sentence -> embedding."""
    import httpx

    response = httpx.post(f"{base_url}/predict", json={"inputs": list(SENTENCES)}, timeout=60.0)
    response.raise_for_status()
    return dict(zip(SENTENCES, response.json()["outputs"], strict=True))


@dataclass
class BatchSampler:
    """Samples, while the load runs, the workers' heartbeat totals (seconds, batches, items) and
    the items in the request stream, waiting or being run (seconds, items)."""

    client: redis.Redis
    keys: Keys
    interval: float = 0.25
    points: list[tuple[float, int, int]] = field(default_factory=list)
    queued: list[tuple[float, int]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def totals(self) -> tuple[int, int]:
        batches, items, _ = fleet_totals(self.client, self.keys)
        return batches, items

    def wait_for_items(self, count: int, timeout: float = 3.0) -> None:
        """Heartbeats publish the totals every half second: wait (at most ``timeout``) until they
        count ``count`` items in all."""
        deadline = time.monotonic() + timeout
        while self.totals()[1] < count and time.monotonic() < deadline:
            time.sleep(0.1)

    def sample(self, t0: float) -> None:
        now = time.perf_counter() - t0
        self.points.append((now, *self.totals()))
        # Workers delete an entry once it is answered: the stream holds what waits or runs.
        self.queued.append((now, int(self.client.xlen(self.keys.requests))))

    def run(self, t0: float) -> None:
        while not self._stop.wait(self.interval):
            self.sample(t0)

    @contextlib.contextmanager
    def sampling(self) -> Iterator[None]:
        t0 = time.perf_counter()
        self.sample(t0)
        thread = threading.Thread(target=self.run, args=(t0,), name="demo-batches", daemon=True)
        thread.start()
        try:
            yield
        finally:
            self._stop.set()
            thread.join()
        self.sample(t0)


# What it shows -------------------------------------------------------------------------------


def check_meaning(reference: dict[str, list[float]]) -> tuple[int, int]:
    """(triples whose paraphrase is closer than the unrelated sentence, triples)."""
    passed = sum(cosine(reference[a], reference[p]) > cosine(reference[a], reference[u]) for a, p, u in TRIPLES)
    return passed, len(TRIPLES)


def inconsistent(samples: list[Sample], reference: dict[str, list[float]]) -> int:
    """Answers of the load that differ from the same sentence's embedding in the check call:
    a sentence must embed the same way whatever batch it lands in (up to float noise)."""
    return sum(s.vector is not None and cosine(reference[s.sentence], s.vector) < 0.999 for s in samples)


def percentile(values: list[float], q: float) -> float:
    value = metrics.percentile(values, q)
    return float("nan") if value is None else value


def batch_series(points: list[tuple[float, int, int]]) -> list[tuple[float, float]]:
    """(seconds, mean batch size of the batches run since the previous point)."""
    series = []
    for (_, b0, i0), (t1, b1, i1) in pairwise(points):
        if b1 > b0:
            series.append((t1, (i1 - i0) / (b1 - b0)))
    return series


def mean_batch(points: list[tuple[float, int, int]], start: float, end: float) -> float:
    """The mean batch size of the batches the heartbeats reported between ``start`` and ``end``."""
    inside = [p for p in points if start <= p[0] <= end] or points[-1:]
    before = [p for p in points if p[0] < start][-1:] or inside[:1]
    batches, items = inside[-1][1] - before[0][1], inside[-1][2] - before[0][2]
    return items / batches if batches else float("nan")


def throughput_series(samples: list[Sample], width: float = 0.5) -> list[tuple[float, float]]:
    """(start of each ``width``-second bin, answered requests per second in it), from the load's start."""
    ends = [s.started + s.latency for s in samples if s.status == 200]
    if not ends:
        return []
    counts = [0] * (int(max(ends) / width) + 1)
    for end in ends:
        counts[int(end / width)] += 1
    return [(i * width, count / width) for i, count in enumerate(counts)]


def phase_rows(samples: list[Sample], phases: list[Phase], sampler: BatchSampler) -> list[str]:
    """One line per phase: clients, answered, requests/s, p50/p99 latency, items in Redis, mean batch."""
    rows = ["  clients  via     answered  requests/s  p50 ms  p99 ms  in Redis  mean batch"]
    for phase in phases:
        ok = [s for s in samples if s.status == 200 and phase.start <= s.started < phase.end]
        latencies = [s.latency * 1000 for s in ok]
        queued = [n for at, n in sampler.queued if phase.start <= at <= phase.end]
        batch = mean_batch(sampler.points, phase.start, phase.end)
        rows.append(f"  {phase.clients:7d}  {phase.via:6s}  {len(ok):8d}  "
                    f"{len(ok) / max(phase.end - phase.start, 1e-9):10.1f}  "
                    f"{percentile(latencies, 0.5):6.0f}  {percentile(latencies, 0.99):6.0f}  "
                    f"{sum(queued) / max(len(queued), 1):8.0f}  {batch:10.1f}")
    return rows


def why_this_batch_size(workers: int, batch_size: int, max_latency: float) -> str:
    """What bounds the batches: the items waiting in Redis, which the callers' concurrency bounds."""
    text = (f"Why the batches are this size: a worker batches the items waiting in Redis when it reads (at most "
            f"--batch-size {batch_size}, or what arrives within --max-latency {max_latency:g} s). A client waits "
            f"for its answer before it sends again, so N clients keep at most N items in Redis, shared by "
            f"{workers} worker{'s' if workers != 1 else ''}: a batch holds at most about N/{workers}, fewer while "
            f"requests are on their way through HTTP and the web app (the 'in Redis' column). Batches fill once "
            f"more items wait than the workers take per read (about {workers} x {batch_size} = "
            f"{workers * batch_size} here); the same model then answers more items per second, and latency grows "
            f"with the queue. The workers also group texts of similar length, so that short ones are not padded "
            f"to the longest: a queue of mixed lengths fills batches more slowly. The web app on one machine "
            f"delivers a limited number of requests at once; the '{CLIENT}' phase calls the workers through the "
            f"Python client (AsyncRedisStreamer) from many concurrent callers, as a fleet of web processes would.")
    return textwrap.fill(text, 96)


# The plot ------------------------------------------------------------------------------------


def plot(samples: list[Sample], series: list[tuple[float, float]], path: Path, batch_size: int,
         phases: list[Phase] | None = None) -> None:
    """Write :func:`figure` to ``path`` (PNG)."""
    import matplotlib.pyplot as plt

    drawing = figure(samples, series, batch_size, phases)
    path.parent.mkdir(parents=True, exist_ok=True)
    drawing.savefig(path, dpi=110)
    plt.close(drawing)


def figure(samples: list[Sample], series: list[tuple[float, float]], batch_size: int,
           phases: list[Phase] | None = None) -> Any:
    """Latency of each request, throughput, and the workers' mean batch size against the
    ``--batch-size`` limit, over the seconds of the load; each phase shaded and labelled with
    its number of concurrent clients."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [s for s in samples if s.status == 200]
    drawing, (top, middle, bottom) = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    top.scatter([s.started for s in ok], [s.latency * 1000 for s in ok], s=4, alpha=0.4)
    top.set_ylabel("request latency (ms)")
    top.set_yscale("log")  # milliseconds for one client, seconds under a deep queue
    top.set_title("rstreamer demo: more concurrent clients, bigger batches, more requests/s")
    rates = throughput_series(samples)
    if rates:
        middle.step([t for t, _ in rates], [r for _, r in rates], where="post", color="tab:green")
    middle.set_ylabel("answered requests/s")
    middle.set_ylim(bottom=0)
    if series:
        bottom.step([t for t, _ in series], [b for _, b in series], where="post", label="mean batch size")
    bottom.axhline(batch_size, color="tab:red", linestyle="--", label=f"batch size limit (--batch-size {batch_size})")
    bottom.set_ylim(0, batch_size * 1.15)
    bottom.set_ylabel("items per batch")
    bottom.set_xlabel("seconds since the load started")
    bottom.legend(loc="lower right")
    _shade_phases([top, middle, bottom], phases or [])
    drawing.tight_layout()
    return drawing


def _shade_phases(axes: list[Any], phases: list[Phase]) -> None:
    for n, phase in enumerate(phases):
        for axis in axes:
            axis.axvspan(phase.start, phase.end, color="0.9" if n % 2 else "0.97", zorder=0)
        label = f"{phase.clients} HTTP\nclients" if phase.via == HTTP else f"{phase.clients} callers\n(Python client)"
        axes[0].text((phase.start + phase.end) / 2, 0.97, label,
                     transform=axes[0].get_xaxis_transform(), ha="center", va="top", fontsize=8)
