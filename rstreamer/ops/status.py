"""What ``rstreamer status`` reports: queue depth, pending, dead letters, live workers, throughput.

Each snapshot reads, for every prefix asked about, the workers hash with the server's time (one
script call per prefix, so it also works on Redis Cluster), then XLEN, XPENDING summary and XLEN
of the dead stream (one pipelined round trip). Throughput comes from two snapshots ``interval``
seconds apart: for each worker live in both, the growth of the ``items`` and ``batches``
counters of its heartbeat divided by the time between its two heartbeat stamps (the Redis
server's clock), summed over workers. Heartbeats come every ``heartbeat_interval`` (0.5 s by
default), so a 1 s window is a coarse, recent rate, not an average since start.
"""
from __future__ import annotations

import difflib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import redis

from ..batching.priority import Levels
from ..broker.connection import RedisClient, StreamRows, is_nogroup
from ..errors import PrefixInUse
from ..wire.keys import REQUESTS_PATTERN, Keys, prefix_of_requests_key
from ..wire.published import live_workers, published_levels, read_workers
from ..wire.scripts import scripts
from .pace import PACE_FIELD, Capacity, added_counts, drain_seconds, fleet_capacity, pace_of, quantile_ms

_WORKER_COUNTERS = ("batches", "items", "errors", "expired", "reclaimed", "dead_lettered", "cancelled")
_SLOT_FIELDS = ("slot", "supervisor", "restarts", "last_exit", "last_exit_at")


@dataclass(frozen=True)
class LevelDepth:
    """One priority level's stream at one instant: its entries, those delivered and not yet
    acked, and when (server ms) its oldest undelivered entry was added (None: none waits).

    ``held``: items held for fair sharing between tenants (see wire/lua/include/fair.lua), included in
    ``stream_length``; ``oldest_ms`` then also covers the item next in line among them.
    """

    level: int
    weight: int
    stream_length: int
    pending: int
    oldest_ms: int | None
    held: int = 0

    @property
    def queue_length(self) -> int:
        """Entries of the level not yet delivered."""
        return max(0, self.stream_length - self.pending)


@dataclass(frozen=True)
class Snapshot:
    """The raw state of one prefix at one instant (server time, ms); totals over its levels."""

    prefix: str
    now_ms: int
    stream_length: int
    pending: int
    pending_by_consumer: dict[str, int]
    dead_letters: int
    workers: dict[str, dict[str, Any]]
    levels: tuple[LevelDepth, ...] = ()
    pace: dict[str, Any] | None = None  # the prefix's remembered pace per worker (rstreamer.ops.pace)

    @property
    def queue_length(self) -> int:
        """Entries not yet delivered: acked entries are XDELed, so XLEN counts waiting plus pending."""
        return max(0, self.stream_length - self.pending)

    def capacity(self, dead_after: float) -> Capacity | None:
        """What the live workers drain per second together (None: no live worker, or no pace known)."""
        live = live_workers(self.now_ms, self.workers, int(dead_after * 1000))
        remembered = pace_of(self.pace) if self.pace else None
        return fleet_capacity([pace_of(self.workers[name].get(PACE_FIELD)) for name in sorted(live)], remembered)


def take_snapshots(client: RedisClient, prefixes: list[str]) -> list[Snapshot]:
    """The workers of each prefix (with its server's clock), its levels, their depths, then one
    pipelined read of the pending lists and dead letters."""
    # read_workers is a script, which a Redis Cluster pipeline cannot carry: one call per prefix.
    heartbeats = [read_workers(client, Keys(prefix)) for prefix in prefixes]
    levels = [published_levels(client, Keys(prefix)) for prefix in prefixes]
    depths = [_depths(client, Keys(prefix), level_set) for prefix, level_set in zip(prefixes, levels, strict=True)]
    pipe = client.pipeline(transaction=False)
    for prefix, level_set in zip(prefixes, levels, strict=True):
        keys = Keys(prefix)
        for level in range(level_set.count):
            pipe.xpending(keys.requests_at(level), keys.group)
        pipe.xlen(keys.dead)
        pipe.get(keys.pace)
    replies = pipe.execute(raise_on_error=False)
    snapshots, at = [], 0
    for prefix, beats, level_depths in zip(prefixes, heartbeats, depths, strict=True):
        count = len(level_depths) + 2
        snapshots.append(_snapshot(prefix, beats, level_depths, replies[at:at + count]))
        at += count
    return snapshots


def _depths(client: RedisClient, keys: Keys, levels: Levels) -> tuple[LevelDepth, ...]:
    script = scripts(client).queue_depths
    reply = script(keys=[key for level in range(levels.count) for key in keys.level_keys(level)], args=[keys.group])
    rows = zip(levels.weights, reply[2:], strict=True)
    return tuple(LevelDepth(level, weight, int(length), int(pending), None if int(oldest) < 0 else int(oldest),
                            int(held))
                 for level, (weight, (length, pending, oldest, held)) in enumerate(rows))


def _snapshot(prefix: str, heartbeats: tuple[int, dict[str, dict[str, Any]]], levels: tuple[LevelDepth, ...],
              replies: list[Any]) -> Snapshot:
    *pendings, dead, pace = replies
    by_consumer: dict[str, int] = {}
    for pending in pendings:
        if is_nogroup(pending):
            continue  # no stream or no group yet: nothing delivered
        if isinstance(pending, Exception):
            raise pending
        for consumer in pending.get("consumers") or []:
            name = _text(consumer["name"])
            by_consumer[name] = by_consumer.get(name, 0) + int(consumer["pending"])
    if isinstance(dead, Exception):
        raise dead
    now_ms, workers = heartbeats
    return Snapshot(Keys(prefix).prefix, now_ms, sum(d.stream_length for d in levels), sum(d.pending for d in levels),
                    by_consumer, int(dead), workers, levels, _pace_json(pace))


def _pace_json(raw: Any) -> dict[str, Any] | None:
    if not isinstance(raw, (bytes, str)):
        return None  # none published (or an error reading it: the pace of the live workers still counts)
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def level_rows(snapshot: Snapshot, capacity: Capacity | None = None) -> list[dict[str, Any]]:
    """One object per priority level: weight, depth (held items included, and apart), pending, the
    wait of its oldest undelivered entry (s), and the expected time to drain its entries, waiting
    and pending, at ``capacity`` (``drain_s``; None: a backlog that no live worker drains)."""
    return [{"level": d.level, "weight": d.weight, "queue_length": d.queue_length, "held": d.held, "pending": d.pending,
             "oldest_wait_s": round(max(0, snapshot.now_ms - d.oldest_ms) / 1000, 3) if d.oldest_ms else 0.0,
             "drain_s": _finite(drain_seconds(d.queue_length + d.pending, capacity))}
            for d in snapshot.levels]


def _finite(seconds: float) -> float | None:
    """Seconds for JSON (which has no infinity): None for an unbounded wait."""
    return None if math.isinf(seconds) else round(seconds, 3)


def drain_report(snapshot: Snapshot, dead_after: float) -> dict[str, Any]:
    """The expected drain time of the whole prefix (``seconds``; None: a backlog that no live
    worker drains) and the capacity it is measured against (None: unknown)."""
    capacity = snapshot.capacity(dead_after)
    backlog = snapshot.queue_length + snapshot.pending
    return {"seconds": _finite(drain_seconds(backlog, capacity)), "backlog": backlog,
            "items_per_s": round(capacity.items_per_s, 2) if capacity else None,
            "cost_per_item": round(capacity.cost_per_item, 3) if capacity else None}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def worker_rows(snapshot: Snapshot, dead_after: float) -> list[dict[str, Any]]:
    """One object per live worker (heartbeat at most ``dead_after`` seconds old), sorted by name."""
    rows = []
    for name in sorted(live_workers(snapshot.now_ms, snapshot.workers, int(dead_after * 1000))):
        info = snapshot.workers[name]
        row = {"name": name, "host": info.get("host"), "pid": info.get("pid"), "gpu": info.get("gpu"),
               "last_seen_s": round(max(0, snapshot.now_ms - info["seen_ms"]) / 1000, 3)}
        row.update({counter: int(info.get(counter, 0)) for counter in _WORKER_COUNTERS})
        row["pending"] = snapshot.pending_by_consumer.get(name, 0)
        row["cost_cap"] = info.get("cost_cap")  # learned from out-of-memory errors; None: none
        # From its supervisor (rstreamer-worker): its slot, and how often that slot's worker was replaced.
        row.update({field: info.get(field) for field in _SLOT_FIELDS})
        row["started"] = info.get("started")
        row["items_per_busy_s"] = pace_of(info.get(PACE_FIELD)).items_per_s
        rows.append(row)
    return rows


def throughput(before: Snapshot, after: Snapshot, dead_after: float) -> dict[str, float]:
    """Items/s and batches/s of the workers live in ``after`` between the two snapshots."""
    rates = {"items": 0.0, "batches": 0.0}
    for name in live_workers(after.now_ms, after.workers, int(dead_after * 1000)):
        old, new = before.workers.get(name), after.workers[name]
        if not old:
            continue  # a new worker
        seconds = (new["seen_ms"] - old["seen_ms"]) / 1000
        if seconds <= 0:
            continue  # no heartbeat between the snapshots
        for counter in rates:
            rates[counter] += max(0, new.get(counter, 0) - old.get(counter, 0)) / seconds
    return {"items_per_s": round(rates["items"], 2), "batches_per_s": round(rates["batches"], 2),
            "window_s": round((after.now_ms - before.now_ms) / 1000, 3)}


def pace_report(before: Snapshot, after: Snapshot, dead_after: float) -> dict[str, Any]:
    """What the live workers of ``after`` did since ``before``: per item, queue wait and latency
    (XADD to the reply in Redis) p50/p99 in ms (None: no item), and the mean batch size against the
    largest batch they are configured for."""
    live = live_workers(after.now_ms, after.workers, int(dead_after * 1000))
    pairs = [(before.workers.get(name) or {}, after.workers[name]) for name in sorted(live)]
    paces = [(pace_of(old.get(PACE_FIELD)), pace_of(new.get(PACE_FIELD))) for old, new in pairs]
    wait = added_counts((old.wait, new.wait) for old, new in paces)
    latency = added_counts((old.latency, new.latency) for old, new in paces)
    items = sum(max(0, int(new.get("items", 0)) - int(old.get("items", 0))) for old, new in pairs)
    batches = sum(max(0, int(new.get("batches", 0)) - int(old.get("batches", 0))) for old, new in pairs)
    limits = [new.batch_size for _, new in paces if new.batch_size]
    return {"window_s": round((after.now_ms - before.now_ms) / 1000, 3),
            "wait_p50_ms": _ms(quantile_ms(wait, 0.5)), "wait_p99_ms": _ms(quantile_ms(wait, 0.99)),
            "latency_p50_ms": _ms(quantile_ms(latency, 0.5)), "latency_p99_ms": _ms(quantile_ms(latency, 0.99)),
            "batch_mean": round(items / batches, 2) if batches else None, "batch_limit": max(limits, default=None)}


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def prefix_status(
    client: RedisClient,
    prefix: str,
    dead_after: float,
    interval: float = 1.0,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, Any]:
    """The status of one prefix; throughput is measured over ``interval`` seconds (0: not measured)."""
    first = take_snapshots(client, [prefix])[0]
    last = first
    if interval > 0:
        sleep(interval)
        last = take_snapshots(client, [prefix])[0]
    workers = worker_rows(last, dead_after)
    return {
        "prefix": last.prefix,
        "state": prefix_state(len(workers), last.queue_length + last.pending),
        "queue_length": last.queue_length,
        "pending": last.pending,
        "dead_letters": last.dead_letters,
        "drain": drain_report(last, dead_after),
        "levels": level_rows(last, last.capacity(dead_after)),
        "workers": workers,
        "throughput": throughput(first, last, dead_after) if interval > 0 else None,
    }


def prefix_known(client: RedisClient, prefix: str) -> bool:
    """True when anything exists under ``prefix``: its request stream (a worker or a call
    creates it), a worker's heartbeat, a dead letter or a job. False for a misspelt prefix."""
    keys = Keys(prefix)
    # One slot (the keys share their hash tag), so one EXISTS works on Redis Cluster too.
    return bool(client.exists(keys.requests, keys.workers, keys.dead, keys.jobs))


def unknown_prefix_message(client: RedisClient, prefix: str, where: str) -> str:
    """Why ``prefix`` shows nothing at ``where`` (a redacted URL), and which prefixes this Redis
    does have, the likeliest meant first: a misspelt prefix is the usual cause."""
    prefix = Keys(prefix).prefix
    known = list_prefixes(client)
    close = difflib.get_close_matches(prefix, known, n=10, cutoff=0.5)
    known = close + [name for name in known if name not in close]
    shown = ", ".join(known[:10]) + (f" and {len(known) - 10} more" if len(known) > 10 else "")
    return (f"prefix {prefix!r} is unknown at {where}: no request stream, worker, dead letter or job under it "
            f"({'known prefixes: ' + shown if known else 'no prefix is known there'})")


def list_prefixes(client: RedisClient) -> list[str]:
    """Every prefix that has a request stream (SCAN, so it does not block the server)."""
    found = set()
    for key in client.scan_iter(match=REQUESTS_PATTERN, count=1000):
        prefix = prefix_of_requests_key(_text(key))
        if prefix:
            found.add(prefix)
    return sorted(found)


def prefix_state(live: int, waiting: int) -> str:
    """``serving`` (a live worker), ``unserved`` (items wait or are pending, no live worker) or
    ``idle`` (no live worker and nothing waiting: a prefix nobody may use any more; ``rstreamer
    forget`` deletes it)."""
    if live:
        return "serving"
    return "unserved" if waiting else "idle"


def all_prefixes_status(client: RedisClient, dead_after: float) -> list[dict[str, Any]]:
    """A one-line summary of every prefix, with its :func:`prefix_state` and its expected drain time."""
    rows = []
    for s in take_snapshots(client, list_prefixes(client)):
        live = len(live_workers(s.now_ms, s.workers, int(dead_after * 1000)))
        rows.append({"prefix": s.prefix, "queue_length": s.queue_length, "pending": s.pending,
                     "dead_letters": s.dead_letters, "live_workers": live,
                     "state": prefix_state(live, s.queue_length + s.pending),
                     "drain_s": drain_report(s, dead_after)["seconds"]})
    return rows


def format_prefix_status(status: dict[str, Any]) -> str:
    """``status`` (from :func:`prefix_status`) as a human-readable table."""
    lines = [
        f"prefix        {status['prefix']}" + (f"  ({_STATE_NOTES[status['state']]})" if status.get("state") in
                                                _STATE_NOTES else ""),
        f"queue length  {status['queue_length']}  (waiting, not yet delivered)",
        f"pending       {status['pending']}  (delivered to a worker, not yet acked)",
        f"dead letters  {status['dead_letters']}",
    ]
    if status.get("drain"):
        lines.append(f"drain time    {format_drain(status['drain'])}")
    levels = status.get("levels") or []
    if len(levels) > 1:
        lines.append("levels        " + "; ".join(
            f"{row['level']} (weight {row['weight']}): {row['queue_length']} waiting, {row['pending']} pending, "
            f"oldest {row['oldest_wait_s']:.3f}s, drain {_seconds(row.get('drain_s'))}" for row in levels))
    rate = status.get("throughput")
    if rate:
        lines.append(f"throughput    {rate['items_per_s']:.1f} items/s, {rate['batches_per_s']:.1f} batches/s "
                     f"(last {rate['window_s']:.1f}s)")
    lines.append(f"workers       {len(status['workers'])} live")
    columns = ("name", "host", "pid", "gpu", "last_seen_s", "batches", "items", "errors", "pending", "cost_cap")
    rows = [[_cell(worker.get(c)) for c in columns] for worker in status["workers"]]
    return "\n".join(lines + ([""] + _table(columns, rows) if rows else []))


def format_drain(drain: dict[str, Any]) -> str:
    """The drain line of ``rstreamer status``: how long the backlog takes, at what pace."""
    if not drain["backlog"]:
        return "0s (nothing waiting)"
    if drain["seconds"] is None:
        return f"unbounded: {drain['backlog']} items wait and no live worker drains them"
    cost = drain["cost_per_item"]
    per_item = f", mean cost {cost:g} per item" if cost and cost != 1 else ""
    return f"{drain['seconds']:.1f}s for {drain['backlog']} items at {drain['items_per_s']:.1f} items/s{per_item}"


def _seconds(value: float | None) -> str:
    return "unbounded" if value is None else f"{value:.1f}s"


def format_all_prefixes(summaries: list[dict[str, Any]]) -> str:
    """The summaries of :func:`all_prefixes_status` as a table."""
    if not summaries:
        return "no prefixes (no request stream found)"
    columns = ("prefix", "state", "queue_length", "pending", "dead_letters", "live_workers", "drain_s")
    rows = [[_cell(s.get(c)) if c != "drain_s" else _drain_cell(s) for c in columns] for s in summaries]
    lines = _table(columns, rows)
    if any(s.get("state") == "idle" for s in summaries):
        lines.append(f"\nidle: {_STATE_NOTES['idle']}")
    return "\n".join(lines)


_STATE_NOTES = {
    "idle": "no live worker and nothing queued; `rstreamer forget PREFIX` deletes a prefix nobody uses",
    "unserved": "items wait and no live worker serves them",
}


def _drain_cell(summary: dict[str, Any]) -> str:
    if "drain_s" not in summary:
        return "-"
    if summary["drain_s"] is None:
        return "unbounded"
    return f"{summary['drain_s']:.1f}"


def _cell(value: Any) -> str:
    return "-" if value is None else str(value)


def _table(columns: tuple[str, ...], rows: list[list[str]]) -> list[str]:
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(columns)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*(c.upper() for c in columns)).rstrip()] + [fmt.format(*row).rstrip() for row in rows]


def oldest_waiting_ms(client: RedisClient, keys: Keys) -> int | None:
    """When (server ms, from its entry id) the oldest entry not yet delivered to a worker was added.

    An entry id's first part is the Redis server's clock when XADD ran, so comparing it with the
    server's TIME gives a wait free of any host's clock skew. None when nothing waits.
    """
    try:
        groups = client.xinfo_groups(keys.requests)
    except redis.ResponseError:
        return None  # no stream yet
    last = next((g["last-delivered-id"] for g in groups if _text(g["name"]) == keys.group), b"0-0")
    start = b"(" + (last if isinstance(last, bytes) else last.encode())
    oldest = cast(StreamRows, client.xrange(keys.requests, min=start, count=1))
    return int(oldest[0][0].split(b"-")[0]) if oldest else None


def prefix_keys(client: RedisClient, prefix: str) -> list[str]:
    """Every key of ``prefix`` (SCAN, so a large Redis is not blocked), sorted."""
    return sorted({_text(key) for key in client.scan_iter(match=Keys(prefix).pattern, count=1000)})


def forget_prefix(client: RedisClient, prefix: str, dead_after: float, chunk: int = 500) -> int:
    """Delete every key of ``prefix`` (its streams, dead letters, jobs, replies...); how many.

    Raises:
        PrefixInUse: a worker heart-beat on the prefix within ``dead_after`` seconds: a prefix
            that is served is never forgotten (its workers would only recreate it, half).
    """
    keys = Keys(prefix)
    now_ms, workers = read_workers(client, keys)
    live = sorted(live_workers(now_ms, workers, int(dead_after * 1000)))
    if live:
        raise PrefixInUse(f"prefix {keys.prefix!r} has {len(live)} live worker(s) ({', '.join(live[:5])}"
                          f"{' ...' if len(live) > 5 else ''}); stop them first")
    names = prefix_keys(client, keys.prefix)
    deleted = 0
    for start in range(0, len(names), chunk):
        # One slot (the keys share their hash tag): a multi-key UNLINK works on Redis Cluster too.
        deleted += int(client.unlink(*names[start:start + chunk]))
    return deleted
