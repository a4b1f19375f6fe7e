"""`rstreamer bench hotpath`: what one item costs on the hot path (issue 26), side by side in one run.

A no-op model, one worker process (``rstreamer-worker``), callers in this process, one private
redis-server. For a lone caller (one call at a time) and for ``--callers`` concurrent callers it
measures, per item answered: the CPU of the client process (this one: its callers and I/O
threads), of the worker process tree and of Redis (INFO cpu), and the Redis commands Redis ran
(INFO commandstats: a script's inner calls are counted there, besides its EVALSHA), and the
client's context switches (getrusage). Beside the lone caller, the *round trip floor*: the same
lone calls written by hand (XADD and BLPOP from this process; XREADGROUP, then RPUSH, PEXPIRE, XACK
and XDEL in one pipeline from a worker process of a few lines), no scripts, no checks, no
rstreamer: what Redis spends on such a round trip on this machine, below which no broker of
this shape goes. Beside the load, the *thread floor*: the same callers parking
on a lock each until one thread answers them in groups, with no Redis and no rstreamer, which is
what any thread-per-caller client pays on this machine before doing anything. Then the same load
from ``--callers`` asyncio tasks of an ``AsyncRedisStreamer`` in one event loop (the client of
ASGI apps), per item the same figures. Then an A/B:
items/s of a bare prefix against prefixes whose lanes are configured but idle (priority levels,
tenant quotas, jobs and webhooks; the same plus fair sharing), in alternating rounds, both
workers alive throughout. Beside them, what an answer of an embedding model costs the codec
(a vector of 768 float32): its encoding and its reply row in the worker, its decoding in the
client, best of three timings. Last, the run against issue 26's reference points (the targets of
the hot path in docs/performance.md): reached or not, each.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import queue
import resource
import statistics
import subprocess
import sys
import threading
import time
import timeit
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import redis

from rstreamer import codec
from rstreamer.batching.batcher import Outcome
from rstreamer.broker.embedded import EmbeddedRedis
from rstreamer.client.aio import AsyncRedisStreamer
from rstreamer.client.sync import RedisStreamer
from rstreamer.ops.metrics import percentile
from rstreamer.wire.messages import pack_results
from rstreamer.wire.published import wait_for_live_workers
from rstreamer_tools.bench import format_reference_checks, reference_check
from rstreamer_tools.processes import stop_group

ECHO = "workers.echo:EchoModel"
LANES = ["--priorities", "4,2,1", "--level-max-queue", "100000,100000,100000", "--tenant-rate", "100000",
         "--tenant-burst", "100000", "--webhook-allow", "127.0.0.1"]
"""Every lane a prefix can use besides fair sharing, configured (jobs need no option: one is run
before measuring)."""
IGNORED = {"info", "ping", "client|setinfo", "client|setname", "hello", "script|load"}
"""Commands that the bench's own probes and the clients' connection set-up send."""


@dataclass(frozen=True)
class Sample:
    """CPU seconds so far of the client, the worker tree and Redis, and Redis's command counts."""

    client: float
    worker: float
    redis: float
    commands: dict[str, int]
    usec: dict[str, int]
    switches: int = 0  # the client process's context switches (voluntary and involuntary) so far


@dataclass
class Row:
    """One measured phase: per item CPU (µs) and commands, items/s and latencies (ms)."""

    name: str
    items: int = 0
    seconds: float = 0.0
    items_per_s: float = 0.0
    client_us: float = 0.0
    worker_us: float = 0.0
    redis_us: float = 0.0
    commands: float = 0.0
    p50_ms: float | None = None
    p99_ms: float | None = None
    switches: float = 0.0  # the client's context switches per item
    # A/B rows: the median over the rounds of this prefix's items/s against the bare prefix's of
    # the same round, in % (see a_b).
    against_bare: float | None = None
    by_command: dict[str, float] = field(default_factory=dict)
    usec_by_command: dict[str, float] = field(default_factory=dict)


def tree_cpu(pid: int) -> float:
    """CPU seconds (user and system) of process ``pid`` and its descendants, from /proc (Linux);
    processes gone meanwhile count 0."""
    stats: dict[int, tuple[int, float]] = {}  # pid -> (parent, CPU seconds)
    tick = os.sysconf("SC_CLK_TCK")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # The command name (field 2) may hold spaces: the fields after it follow its ')'.
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        stats[int(entry.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    tree, total = {pid}, 0.0
    for _ in range(8):  # a supervisor, its workers, their helpers: a shallow tree
        tree |= {child for child, (parent, _) in stats.items() if parent in tree}
    for member in tree:
        total += stats.get(member, (0, 0.0))[1]
    return total


class Meter:
    """Samples the three processes' CPU and Redis's command counts."""

    def __init__(self, client: redis.Redis, worker_pid: int) -> None:
        self._redis = client
        self._worker = worker_pid

    def sample(self) -> Sample:
        cpu = self._redis.info("cpu")
        stats = self._redis.info("commandstats")
        commands = {name.removeprefix("cmdstat_"): int(value["calls"]) for name, value in stats.items()}
        usec = {name.removeprefix("cmdstat_"): int(value["usec"]) for name, value in stats.items()}
        return Sample(time.process_time(), tree_cpu(self._worker),
                      float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"]), commands, usec, switches())


def switches() -> int:
    """Context switches of this process so far, voluntary and involuntary, every thread's (those
    that ended too: Linux keeps their counts)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_nvcsw + usage.ru_nivcsw


def fill(row: Row, before: Sample, after: Sample, items: int, seconds: float) -> Row:
    """``row`` with the per item costs between two samples."""
    row.items, row.seconds = items, seconds
    row.items_per_s = items / seconds if seconds else 0.0
    per = 1e6 / max(1, items)
    row.client_us = (after.client - before.client) * per
    row.worker_us = (after.worker - before.worker) * per
    row.redis_us = (after.redis - before.redis) * per
    row.switches = (after.switches - before.switches) / max(1, items)
    delta = {name: calls - before.commands.get(name, 0) for name, calls in after.commands.items()}
    counted = {name: calls / max(1, items) for name, calls in delta.items() if calls and name not in IGNORED}
    row.by_command = dict(sorted(counted.items(), key=lambda kv: -kv[1]))
    row.commands = sum(counted.values())
    # A script's time includes its inner commands' (which commandstats also lists on their own).
    usec = {name: (spent - before.usec.get(name, 0)) / max(1, items) for name, spent in after.usec.items()}
    row.usec_by_command = {name: round(usec[name], 2) for name in row.by_command}
    return row


def lone(streamer: RedisStreamer, meter: Meter, calls: int, name: str) -> Row:
    """``calls`` single-item calls, one at a time."""
    return one_at_a_time(lambda n: streamer.predict([f"item {n}"], timeout=20), meter, calls, name)


def one_at_a_time(call: Callable[[int], object], meter: Meter, calls: int, name: str) -> Row:
    """``call(n)`` for n in 0 .. ``calls`` - 1, one after another, after 20 to warm up (connections,
    scripts loaded, a worker's imports): the per item costs and the latencies."""
    for n in range(20):
        call(n)
    latencies = []
    before, started = meter.sample(), time.perf_counter()
    for n in range(calls):
        t0 = time.perf_counter()
        call(n)
        latencies.append(time.perf_counter() - t0)
    seconds = time.perf_counter() - started
    row = fill(Row(name), before, meter.sample(), calls, seconds)
    row.p50_ms, row.p99_ms = _ms(percentile(latencies, 0.5)), _ms(percentile(latencies, 0.99))
    return row


FLOOR_WORKER = """
import sys, redis
client, stream = redis.Redis.from_url(sys.argv[1]), sys.argv[2]
while True:
    for _, entries in client.xreadgroup("g", "w", {stream: ">"}, count=32, block=1000) or []:
        pipe = client.pipeline(transaction=False)
        for _, fields in entries:
            pipe.rpush(fields[b"r"], fields[b"p"])
            pipe.pexpire(fields[b"r"], 30000)
        ids = [entry_id for entry_id, _ in entries]
        pipe.xack(stream, "g", *ids)
        pipe.xdel(stream, *ids)
        pipe.execute()
"""
"""The round trip floor's worker: reads, answers each entry to its reply key, acks and deletes."""


def round_trip_floor(url: str, probe: redis.Redis, calls: int) -> Row:
    """``calls`` lone round trips written by hand (see the module's docstring): Redis's CPU and
    commands per item, and the latencies, for the lone caller's row to be read against."""
    stream, reply = f"floor-{uuid.uuid4().hex[:6]}", f"floor-reply-{uuid.uuid4().hex[:6]}"
    probe.xgroup_create(stream, "g", "0", mkstream=True)
    process = subprocess.Popen([sys.executable, "-c", FLOOR_WORKER, url, stream], start_new_session=True)
    try:
        def call(n: int) -> None:
            probe.xadd(stream, {"r": reply, "p": f"item {n}"})
            if probe.blpop([reply], timeout=20) is None:
                raise RuntimeError("the round trip floor's worker did not answer within 20 s")

        return one_at_a_time(call, Meter(probe, process.pid), calls, "round trip floor")
    finally:
        stop_group(process, grace=5)
        probe.delete(stream, reply)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def load(streamer: RedisStreamer, meter: Meter | None, callers: int, seconds: float, name: str) -> Row:
    """``callers`` threads calling one item at a time for ``seconds`` (after a short ramp)."""
    stop = threading.Event()
    counting = threading.Event()
    done = [0] * callers
    latencies: list[list[float]] = [[] for _ in range(callers)]

    def caller(slot: int) -> None:
        n = 0
        while not stop.is_set():
            t0 = time.perf_counter()
            streamer.predict([f"{slot} {n}"], timeout=20)
            if counting.is_set():
                done[slot] += 1
                latencies[slot].append(time.perf_counter() - t0)
            n += 1

    threads = [threading.Thread(target=caller, args=(i,), daemon=True) for i in range(callers)]
    for thread in threads:
        thread.start()
    time.sleep(0.5)
    before = meter.sample() if meter else None
    counting.set()
    started = time.perf_counter()
    time.sleep(seconds)
    counting.clear()
    elapsed = time.perf_counter() - started
    after = meter.sample() if meter else None
    stop.set()
    for thread in threads:
        thread.join(30)
    items = sum(done)
    row = Row(name, items, elapsed, items / elapsed)
    if before and after:
        row = fill(row, before, after, items, elapsed)
    every = [value for chunk in latencies for value in chunk]
    row.p50_ms, row.p99_ms = _ms(percentile(every, 0.5)), _ms(percentile(every, 0.99))
    return row


def async_load(url: str, prefix: str, meter: Meter, callers: int, seconds: float, name: str) -> Row:
    """``callers`` asyncio tasks of one AsyncRedisStreamer calling one item at a time for ``seconds``
    (after a short ramp), in an event loop of their own."""
    async def measure() -> Row:
        stop, counting = asyncio.Event(), asyncio.Event()
        latencies: list[float] = []

        async def caller(slot: int) -> None:
            n = 0
            while not stop.is_set():
                t0 = time.perf_counter()
                await streamer.predict([f"{slot} {n}"], timeout=20)
                if counting.is_set():
                    latencies.append(time.perf_counter() - t0)
                n += 1

        async with AsyncRedisStreamer(url, prefix) as streamer:
            tasks = [asyncio.ensure_future(caller(slot)) for slot in range(callers)]
            await asyncio.sleep(0.5)
            before = meter.sample()
            counting.set()
            started = time.perf_counter()
            await asyncio.sleep(seconds)
            counting.clear()
            elapsed, after = time.perf_counter() - started, meter.sample()
            stop.set()
            await asyncio.gather(*tasks)
        row = fill(Row(name), before, after, len(latencies), elapsed)
        row.p50_ms, row.p99_ms = _ms(percentile(latencies, 0.5)), _ms(percentile(latencies, 0.99))
        return row

    return asyncio.run(measure())


ROUND_TRIP = 0.0002
"""Seconds the thread floor's answering thread waits per group: about one Redis round trip here."""


class _Floor:
    """The thread floor's callers and answering thread (see :func:`thread_floor`)."""

    def __init__(self, callers: int) -> None:
        self.waiting: queue.SimpleQueue[threading.Lock] = queue.SimpleQueue()
        self.stopped = threading.Event()
        self.done = [0] * callers
        self.threads = [threading.Thread(target=self.answer, daemon=True)]
        self.threads += [threading.Thread(target=self.caller, args=(i,), daemon=True) for i in range(callers)]

    def caller(self, slot: int) -> None:
        while not self.stopped.is_set():
            parked = threading.Lock()
            parked.acquire()
            self.waiting.put(parked)
            parked.acquire()
            self.done[slot] += 1

    def answer(self) -> None:
        while not self.stopped.is_set():
            try:
                group = [self.waiting.get(timeout=0.1)]
            except queue.Empty:
                continue
            group += self.drain()
            time.sleep(ROUND_TRIP)
            for parked in group:
                parked.release()

    def drain(self) -> list[threading.Lock]:
        taken = []
        with contextlib.suppress(queue.Empty):
            while True:
                taken.append(self.waiting.get_nowait())
        return taken

    def stop(self) -> None:
        self.stopped.set()
        self.threads[0].join(5)
        until = time.monotonic() + 5
        for thread in self.threads[1:]:
            while thread.is_alive() and time.monotonic() < until:
                for parked in self.drain():  # callers parked after the answering thread stopped
                    parked.release()
                thread.join(0.01)


def thread_floor(callers: int, seconds: float) -> Row:
    """The hand-offs alone: ``callers`` threads each park on a lock of their own until one
    answering thread, which takes every queued caller at once and waits ``ROUND_TRIP``, releases
    it; no Redis, no encoding, no rstreamer. Its CPU per item is a floor for any client that
    gives each call a thread of its own and answers it from another."""
    floor = _Floor(callers)
    for thread in floor.threads:
        thread.start()
    time.sleep(0.5)
    cpu, count, before = time.process_time(), sum(floor.done), switches()
    started = time.perf_counter()
    time.sleep(seconds)
    elapsed = time.perf_counter() - started
    items = sum(floor.done) - count
    row = Row("thread floor", items, elapsed, items / elapsed,
              client_us=(time.process_time() - cpu) * 1e6 / max(1, items),
              switches=(switches() - before) / max(1, items))
    floor.stop()
    return row


@contextlib.contextmanager
def worker(url: str, prefix: str, args: argparse.Namespace, extra: Sequence[str] = ()) -> Iterator[int]:
    """One ``rstreamer-worker`` of the echo model on ``prefix``; yields its pid once it beats."""
    command = [sys.executable, "-c", "from rstreamer.cli import worker_main; worker_main()",
               "--redis", url, "--prefix", prefix, "--batch-size", str(args.batch_size),
               "--max-latency", str(args.max_latency),
               "--log-level", "WARNING", *extra, ECHO]
    path = os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    process = subprocess.Popen(command, env=env, start_new_session=True)
    try:
        with RedisStreamer(url, prefix) as streamer:
            wait_for_live_workers(streamer.redis, streamer.keys, 1, timeout=120)
        settle(process.pid)
        yield process.pid
    finally:
        stop_group(process, grace=10)


def settle(pid: int, quiet: float = 0.05, timeout: float = 30.0) -> None:
    """Wait until the worker tree has finished starting (its heartbeat process imports for a
    while after the first beat): less than ``quiet`` CPU seconds in half a second."""
    deadline = time.monotonic() + timeout
    last = tree_cpu(pid)
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = tree_cpu(pid)
        if now - last < quiet:
            return
        last = now


def idle_job(streamer: RedisStreamer) -> None:
    """Run one small job to its end, so that the prefix's job keys exist but are idle."""
    job = streamer.submit_job([f"job {n}" for n in range(8)])
    job.wait(timeout=60)


def a_b(streams: dict[str, tuple[RedisStreamer, Meter]], args: argparse.Namespace) -> list[Row]:
    """Alternating rounds of each prefix under load; medians of items/s and of the per item costs
    (the worker's: that prefix's worker), and of each round's items/s against the bare prefix's
    in the same round (``against_bare``). The last is the figure to judge by: on a 2-vCPU VM the
    64 threads' client ran in two regimes, about 21,000 or 30,000 items/s whichever prefix it
    called, each lasting a few rounds (docs/performance.md, round 16), and a ratio of medians
    compared rounds of different regimes."""
    rounds: dict[str, list[Row]] = {name: [] for name in streams}
    for _ in range(args.rounds):
        for name, (streamer, meter) in streams.items():
            rounds[name].append(load(streamer, meter, args.callers, args.ab_seconds, name))
    rows = []
    for name, measured in rounds.items():
        def median(attribute: str, rows: list[Row] = measured) -> float:
            return statistics.median(getattr(r, attribute) or 0.0 for r in rows)

        row = Row(name, sum(r.items for r in measured), sum(r.seconds for r in measured), median("items_per_s"),
                  median("client_us"), median("worker_us"), median("redis_us"), median("commands"),
                  median("p50_ms"), median("p99_ms"))
        every = {command for r in measured for command in r.by_command}
        row.by_command = {c: statistics.median(r.by_command.get(c, 0.0) for r in measured) for c in every}
        row.by_command = dict(sorted(row.by_command.items(), key=lambda kv: -kv[1]))
        bare = rounds.get("bare")
        if bare:
            row.against_bare = statistics.median(
                (r.items_per_s / b.items_per_s - 1) * 100 for r, b in zip(measured, bare, strict=True)
                if b.items_per_s)
        rows.append(row)
    return rows


def array_answer(dimensions: int = 768, number: int = 5000) -> dict[str, float] | None:
    """µs an answer of ``dimensions`` float32 costs the codec, best of three timings of ``number``:
    its encoding and its reply row (the worker), its decoding (the client); None without numpy
    (an extra: the rest of the bench needs none)."""
    try:
        import numpy
    except ImportError:
        return None

    vector = numpy.zeros(dimensions, numpy.float32)
    encoded = codec.packb(vector)
    rows: list[tuple[int, Outcome[Any]]] = [(0, Outcome(True, value=vector))]

    def best(call: Callable[[], object]) -> float:
        return round(min(timeit.repeat(call, number=number, repeat=3)) / number * 1e6, 2)

    return {"dimensions": dimensions, "encode_us": best(lambda: codec.packb(vector)),
            "decode_us": best(lambda: codec.unpackb(encoded)), "reply_row_us": best(lambda: pack_results(rows))}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every phase; the document written to bench-hotpath.json."""
    loads = [os.getloadavg()]
    rows: list[Row] = []
    with EmbeddedRedis() as server, contextlib.ExitStack() as stack:
        url = server.url
        probe = stack.enter_context(contextlib.closing(redis.Redis.from_url(url)))
        bare = f"bare-{uuid.uuid4().hex[:6]}"
        pid = stack.enter_context(worker(url, bare, args))
        streamer = stack.enter_context(RedisStreamer(url, bare))
        meter = Meter(probe, pid)
        rows.append(lone(streamer, meter, args.lone_calls, "lone caller"))
        rows.append(round_trip_floor(url, probe, args.lone_calls))
        rows.append(load(streamer, meter, args.callers, args.duration, f"{args.callers} callers"))
        rows.append(thread_floor(args.callers, args.duration))
        rows.append(async_load(url, bare, meter, args.callers, args.duration, f"{args.callers} tasks (asyncio)"))
        if args.rounds:
            streams = {"bare": (streamer, meter)}
            for name, extra in (("lanes idle", LANES), ("lanes idle + fair", [*LANES, "--tenant-sharing", "fair"])):
                prefix = f"{name.split()[-1]}-{uuid.uuid4().hex[:6]}"
                lane_pid = stack.enter_context(worker(url, prefix, args, extra))
                lanes = stack.enter_context(RedisStreamer(url, prefix))
                idle_job(lanes)
                streams[name] = (lanes, Meter(probe, lane_pid))
            ab = a_b(streams, args)
            # A lane unused costs a lone call nothing either: the same calls on the idle lanes.
            rows.append(lone(*streams["lanes idle"], args.lone_calls, "lone caller, lanes idle"))
        else:
            ab = []
    answer = array_answer()
    loads.append(os.getloadavg())
    return {"machine": {"cpus": os.cpu_count(), "load_before": loads[0], "load_after": loads[1],
                        "time": time.strftime("%Y-%m-%dT%H:%M:%S")},
            "options": vars(args), "rows": [asdict(r) for r in rows], "a_b": [asdict(r) for r in ab],
            "array_answer": answer}


LOAD_REFERENCES = (("client_us", "client µs", 40.0), ("worker_us", "worker µs", 15.0), ("redis_us", "Redis µs", 8.0))
"""Issue 26's most CPU per item answered under load, per process (docs/performance.md, the hot path)."""
REFERENCES_TITLE = ("the hot path's reference points of docs/performance.md (set on a 2-vCPU Intel VM; a shared "
                    "machine moves them by about 5 % from run to run)")


def reference_checks(document: dict[str, Any]) -> list[dict[str, Any]]:
    """This run against issue 26's reference points that its rows decide (see bench.reference_check).

    The lone caller's commands are counted to a tenth: the worker's heartbeats and reclaim ticks
    add about 0.02 per item to the 10 a call runs.
    """
    rows = {r["name"]: r for r in document["rows"]}
    callers = document["options"]["callers"]
    checks = []
    lone = rows.get("lone caller")
    if lone:
        checks += [reference_check("lone caller: Redis commands per item", round(lone["commands"], 1), 10, "at most"),
                   reference_check("lone caller: Redis µs per item", lone["redis_us"], 50, "at most")]
        if lone["p50_ms"] is not None:  # no call answered: no latency to judge (not a p50 of 0)
            checks.append(reference_check("lone caller: p50 ms", lone["p50_ms"], 0.5, "lower"))
    idle = rows.get("lone caller, lanes idle")
    if idle:
        checks.append(reference_check("lone caller, lanes idle: Redis commands per item", round(idle["commands"], 1),
                                      10, "at most"))
    for name in (f"{callers} callers", f"{callers} tasks (asyncio)"):
        row = rows.get(name)
        if row:
            checks += [reference_check(f"{name}: {label} per item", row[key], limit, "at most")
                       for key, label, limit in LOAD_REFERENCES]
    ab = {r["name"]: r for r in document["a_b"]}
    # Fair sharing configured for a tenant alone is an idle lane too (its calls go onto the stream
    # directly, see Levels.direct): judged against the same 5 %.
    for name in ("lanes idle", "lanes idle + fair"):
        if "bare" in ab and name in ab and ab["bare"]["items_per_s"]:
            change = against_bare(ab[name], ab["bare"])
            checks.append(reference_check(f"{name}: items/s against the bare prefix, %", change, -5.0))
    return checks


def against_bare(row: dict[str, Any], bare: dict[str, Any]) -> float:
    """An A/B row's items/s against the bare prefix's, in %: the median of the rounds' ratios
    (see a_b), or the ratio of the medians in a document written before it existed."""
    if row.get("against_bare") is not None:
        return float(row["against_bare"])
    return (float(row["items_per_s"]) / float(bare["items_per_s"]) - 1) * 100


def lone_to_floor(document: dict[str, Any]) -> tuple[float, float, float] | None:
    """The lone caller's Redis µs per item, the round trip floor's, and their ratio; None without
    both rows or without a floor to divide by. The floor (the same round trip written by hand)
    moves from one VM to another far more than the ratio does, so the ratio is what compares
    runs on different machines."""
    rows = {r["name"]: r for r in document["rows"]}
    lone, floor = rows.get("lone caller"), rows.get("round trip floor")
    if not lone or not floor or not floor["redis_us"]:
        return None
    return lone["redis_us"], floor["redis_us"], lone["redis_us"] / floor["redis_us"]


def format_report(document: dict[str, Any]) -> str:
    """The rows as text: per item costs, then the A/B, then the reference points."""
    lines = [f"{'phase':<23} {'items/s':>8} {'client µs':>10} {'worker µs':>10} {'redis µs':>9} "
             f"{'cmds':>6} {'p50 ms':>7} {'p99 ms':>7} {'switches':>8}"]
    for r in document["rows"]:
        lines.append(f"{r['name']:<23} {r['items_per_s']:8,.0f} {r['client_us']:10.1f} {r['worker_us']:10.1f} "
                     f"{r['redis_us']:9.1f} {r['commands']:6.2f} {r['p50_ms'] or 0:7.2f} {r['p99_ms'] or 0:7.2f} "
                     f"{r['switches']:8.2f}")
    ratio = lone_to_floor(document)
    if ratio is not None:
        lines.append(f"lone caller: Redis µs per item {ratio[0]:.1f}, {ratio[2]:.2f} times the round trip floor's "
                     f"{ratio[1]:.1f} (the floor moves from one VM to another far more than the ratio)")
    for r in document["rows"]:
        if not r["by_command"]:
            continue  # the thread floor runs no command
        top = ", ".join(f"{name} {calls:.2f}" for name, calls in list(r["by_command"].items())[:14])
        lines.append(f"commands per item, {r['name']}: {top}")
    ab = document["a_b"]
    if ab:
        lines.append(f"A/B, {document['options']['callers']} callers, median of {document['options']['rounds']} "
                     "alternating rounds (against bare: the median of the rounds' ratios):")
        lines += [f"  {r['name']:<18} {r['items_per_s']:8,.0f} items/s  {against_bare(r, ab[0]) / 100:+6.1%}  "
                  f"p50 {r['p50_ms']:.2f} ms; per item µs: client {r['client_us']:.1f}, worker {r['worker_us']:.1f}, "
                  f"Redis {r['redis_us']:.1f}; {r['commands']:.2f} commands" for r in ab]
        for r in ab:
            top = ", ".join(f"{name} {calls:.2f}" for name, calls in list(r["by_command"].items())[:12])
            lines.append(f"commands per item, {r['name']}: {top}")
    answer = document.get("array_answer")  # absent from a document written before it existed
    if answer:
        lines.append(f"an answer of {answer['dimensions']} float32: encoded in {answer['encode_us']:.2f} µs and its "
                     f"reply row in {answer['reply_row_us']:.2f} µs (the worker), decoded in {answer['decode_us']:.2f} "
                     "µs (the client); best of three timings")
    lines.append(format_reference_checks(document["reference_checks"], REFERENCES_TITLE))
    machine = document["machine"]
    lines.append(f"{machine['cpus']} CPUs, load average {machine['load_before'][0]:.2f} before, "
                 f"{machine['load_after'][0]:.2f} after")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="rstreamer bench hotpath", description=__doc__,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-latency", type=float, default=0.05)
    parser.add_argument("--callers", type=int, default=64, help="concurrent callers of the load phases")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds of the measured load phase")
    parser.add_argument("--lone-calls", type=int, default=1000, help="calls of the lone-caller phase")
    parser.add_argument("--rounds", type=int, default=5, help="alternating A/B rounds (0: no A/B)")
    parser.add_argument("--ab-seconds", type=float, default=3.0, help="seconds of each A/B load")
    parser.add_argument("--output", default="bench-output", help="folder for bench-hotpath.json")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the bench; print the report; write ``bench-hotpath.json``."""
    args = parse_args(argv)
    if os.getcwd() not in sys.path:  # the echo model lives in the repository's `workers` package
        sys.path.insert(0, os.getcwd())
    document = run(args)
    document["reference_checks"] = reference_checks(document)
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    (output / "bench-hotpath.json").write_text(json.dumps(document, indent=2))
    print(format_report(document))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
