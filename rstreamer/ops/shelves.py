"""What ``rstreamer status`` and the dashboard show of the shelves: per shelf worker, the models it
holds (and loads, and refuses after a failed load); per model, its holders, backlog, oldest wait,
loads, evictions, load time, resident size and failure.

Read from the shelf's keys (:mod:`rstreamer.wire.shelf`): one script for the fleet's state, one
for every model's queue, as the workers themselves read them.
"""
from __future__ import annotations

from typing import Any

from ..broker.connection import RedisClient
from ..wire.keys import Keys, ShelfKeys
from ..wire.published import published_levels
from ..wire.shelf import FleetState, list_shelves, published_shelf, read_events, read_fleet, read_queues

EVENTS_SHOWN = 20


def shelves_status(client: RedisClient, dead_after: float) -> list[dict[str, Any]]:
    """The status of every shelf published in this Redis."""
    return [shelf_status(client, name, dead_after) for name in list_shelves(client)]


def dashboard_shelves(client: RedisClient, dead_after: float) -> list[dict[str, Any]] | None:
    """What the dashboard's sampler shows of the shelves (its ``shelf`` hook): None without one."""
    return shelves_status(client, dead_after) or None


def shelf_status(client: RedisClient, name: str, dead_after: float, events: int = 0) -> dict[str, Any]:
    """One shelf: its live workers and its models (see the module); ``events``: the newest events to add."""
    skeys = ShelfKeys(name)
    state = read_fleet(client, skeys)
    published = published_shelf(client, skeys) or {}
    names = sorted(set(published.get("models") or {}) | set(state.stats))
    report = {"shelf": name, "digest": published.get("digest"), "workers": worker_rows(state, dead_after),
              "models": model_rows(client, state, names, dead_after)}
    if events:
        report["events"] = read_events(client, skeys, events)
    return report


def worker_rows(state: FleetState, dead_after: float) -> list[dict[str, Any]]:
    """One object per live shelf worker: where it runs, its slots, what it holds, loads and refuses."""
    dead_after_ms = int(dead_after * 1000)
    holdings = state.live_holdings(dead_after_ms)
    rows = []
    for name in sorted(state.live(dead_after_ms)):
        info, holding = state.workers[name], holdings.get(name, {})
        rows.append({"name": name, "host": info.get("host"), "pid": info.get("pid"), "gpu": info.get("gpu"),
                     "slots": info.get("slots"), "policy": info.get("policy"),
                     "held": list(holding.get("held") or []), "loading": list(holding.get("loading") or []),
                     "refusing": list(holding.get("refusing") or []), "loads": int(info.get("loads", 0)),
                     "evictions": int(info.get("evictions", 0)),
                     "last_seen_s": round(max(0, state.now_ms - info["seen_ms"]) / 1000, 3)})
    return rows


def model_rows(client: RedisClient, state: FleetState, names: list[str], dead_after: float) -> list[dict[str, Any]]:
    """One object per model: holders, backlog, oldest wait, loads, evictions, load time, size, failure."""
    dead_after_ms = int(dead_after * 1000)
    holders = state.holders(dead_after_ms, "held")
    loading = state.holders(dead_after_ms, "loading")
    rows = []
    for name in names:
        queue = read_queues(client, [name], published_levels(client, Keys(name)).count)[name]
        stats = state.stats.get(name, {})
        failed = float(stats.get("failed_until", 0)) > state.now_ms
        rows.append({"model": name, "holders": sorted(holders.get(name, ())), "loading": sorted(loading.get(name, ())),
                     "backlog": queue.waiting, "pending": queue.pending, "oldest_wait_s": round(queue.oldest_age, 3),
                     "loads": int(stats.get("loads", 0)), "evictions": int(stats.get("evictions", 0)),
                     "load_s": _number(stats.get("load_s")), "load_s_last": _number(stats.get("load_s_last")),
                     "bytes": int(float(stats.get("bytes", 0))) or None, "waited": int(stats.get("waited", 0)),
                     "failures": int(stats.get("failures", 0)), "error": stats.get("error") if failed else None})
    return rows


def _number(value: str | None) -> float | None:
    return None if value is None else round(float(value), 3)


def format_shelves(shelves: list[dict[str, Any]]) -> str:
    """Every shelf's status as text (see :func:`format_shelf_status`)."""
    return "\n\n".join(format_shelf_status(shelf) for shelf in shelves)


def format_shelf_status(shelf: dict[str, Any]) -> str:
    """One shelf's status: a line per live worker, then a table of its models."""
    lines = [f"shelf {shelf['shelf']}: {len(shelf['workers'])} live workers, {len(shelf['models'])} models"]
    for worker in shelf["workers"]:
        held = ", ".join(worker["held"]) or "nothing"
        extra = "".join(f"; {kind} {', '.join(worker[kind])}" for kind in ("loading", "refusing") if worker[kind])
        lines.append(f"  {worker['name']} (pid {worker['pid']}, {worker['slots']} slots, {worker['policy']}): "
                     f"holds {held}{extra}; {worker['loads']} loads, {worker['evictions']} evictions")
    columns = ("model", "holders", "backlog", "oldest_wait_s", "loads", "evictions", "load_s", "bytes", "waited",
               "error")
    rows = [[_cell(len(row[c]) if c == "holders" else row[c]) for c in columns] for row in shelf["models"]]
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(columns)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines += [fmt.format(*(c.upper() for c in columns)).rstrip()] + [fmt.format(*row).rstrip() for row in rows]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    return "-" if value is None else str(value)
