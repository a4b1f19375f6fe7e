"""The shelf in Redis: what shelf workers publish and read to place a shelf's models among them.

Under the shelf's hash tag (:class:`~rstreamer.wire.keys.ShelfKeys`): the published shelf, the
shelf workers' heartbeats (written by their heartbeat processes), what each worker holds and loads
(written by the worker itself at every change), per-model counters and measures, a capped stream
of events, and one load lease per model. Under each model's own prefix: a marker naming the shelf
(:attr:`~rstreamer.wire.keys.Keys.shelf`), so that clients and web apps know that a live shelf
worker can serve a prefix that no worker holds yet (:func:`read_serving`).

Writers: :mod:`rstreamer.worker.shelf`; readers: the worker gates of the clients and web apps,
``rstreamer status`` and the dashboard.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, cast

from ..broker.connection import RedisClient, StreamRows, is_cluster
from .keys import Keys, ShelfKeys
from .published import LEVELS_TTL_S, LevelsCopy, live_workers, parse_read_workers, parse_workers, server_time_ms
from .scripts import scripts

SHELF_TTL_S = 60
"""How long the published shelf, a prefix's shelf marker and a worker's holdings outlive the last
shelf worker that refreshed them (they refresh them every few seconds)."""
STATS_TTL_S = LEVELS_TTL_S
"""How long a shelf's counters and events outlive their last write."""
EVENTS_MAX_LEN = 2000
"""The events stream keeps about this many of the newest events."""

Heartbeats = tuple[int, dict[str, dict[str, Any]]]
"""The server's time (ms) and every heartbeat, as :func:`rstreamer.wire.published.read_workers` gives them."""


# the published shelf and the prefixes' markers ----------------------------------------------

def publish_shelf(client: RedisClient, skeys: ShelfKeys, public: dict[str, Any], ttl: int = SHELF_TTL_S) -> None:
    """Publish the shelf (its public view: names and batch settings) and mark each of its models'
    prefixes as loadable by this shelf's workers; both expire unless refreshed."""
    pipe = client.pipeline(transaction=False)
    pipe.set(skeys.models, json.dumps(public), ex=ttl)
    for model in public.get("models", {}):
        pipe.set(Keys(model).shelf, skeys.name, ex=ttl)
    pipe.execute()


def published_shelf(client: RedisClient, skeys: ShelfKeys) -> dict[str, Any] | None:
    """The shelf its workers last published (None: none, or it expired)."""
    raw = client.get(skeys.models)
    try:
        value = json.loads(raw) if raw else None
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def list_shelves(client: RedisClient) -> list[str]:
    """The names of the shelves published in this Redis (SCAN, so it does not block the server)."""
    found = set()
    for key in client.scan_iter(match=ShelfKeys("x").models.replace("{shelf:x}", "{shelf:*}"), count=1000):
        text = key.decode() if isinstance(key, bytes) else str(key)
        found.add(text.split("{shelf:", 1)[1].split("}", 1)[0])
    return sorted(found)


def shelf_prefixes(client: RedisClient) -> list[str]:
    """The prefixes of every model of the shelves published in this Redis (their workers may be gone)."""
    names: set[str] = set()
    for shelf in list_shelves(client):
        names |= set((published_shelf(client, ShelfKeys(shelf)) or {}).get("models") or {})
    return sorted(names)


def read_serving(client: RedisClient, keys: Keys, levels: LevelsCopy | None = None) -> Heartbeats:
    """The heartbeats of the workers that can serve ``keys``'s prefix: its own workers and, when a
    shelf's workers can load its model, those shelf workers too (each stamped on the prefix's
    clock and marked with ``"shelf"``). What a worker gate reads: a call to a cold shelf model is
    let through and waits for the load, instead of failing with NoLiveWorker. The published
    levels are read with them, into ``levels`` when given (a streamer's copy)."""
    reply = scripts(client).read_serving(keys=[keys.workers, keys.shelf, keys.levels])
    heartbeats = _serving(reply, levels)
    if not reply[3]:
        return heartbeats
    return merge_shelf(heartbeats, _shelf_name(reply[3]),
                       parse_read_workers(scripts(client).read_workers(keys=[ShelfKeys(_shelf_name(reply[3])).workers])))


async def aread_serving(client: Any, keys: Keys, levels: LevelsCopy | None = None) -> Heartbeats:
    """:func:`read_serving` through an asyncio client."""
    reply = await scripts(client).read_serving(keys=[keys.workers, keys.shelf, keys.levels])
    heartbeats = _serving(reply, levels)
    if not reply[3]:
        return heartbeats
    name = _shelf_name(reply[3])
    return merge_shelf(heartbeats, name,
                       parse_read_workers(await scripts(client).read_workers(keys=[ShelfKeys(name).workers])))


def _serving(reply: list[Any], levels: LevelsCopy | None) -> Heartbeats:
    """The prefix's own heartbeats in a READ_SERVING reply; its levels recorded in ``levels``."""
    if levels is not None:
        levels.update(reply[4])
    return parse_read_workers(reply[:3])


def _shelf_name(raw: Any) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def merge_shelf(heartbeats: Heartbeats, shelf: str, shelf_workers: Heartbeats) -> Heartbeats:
    """A prefix's heartbeats with a shelf's workers added (those not already among them), their
    beats moved onto the prefix's clock (the two may live on different Cluster nodes)."""
    now_ms, workers = heartbeats
    shelf_now, found = shelf_workers
    merged = dict(workers)
    for name, info in found.items():
        if name not in merged:
            merged[name] = {**info, "shelf": shelf, "seen_ms": now_ms - (shelf_now - info["seen_ms"])}
    return now_ms, merged


# the fleet's state ------------------------------------------------------------------------------

@dataclass(frozen=True)
class FleetState:
    """One reading of a shelf's fleet: the server's time (ms), every shelf worker's heartbeat,
    what each holds (``{"held": [...], "loading": [...], "refusing": [...], "slots": n}``) and
    the per-model stats (``stats[model][counter]``)."""

    now_ms: int
    workers: dict[str, dict[str, Any]]
    holdings: dict[str, dict[str, Any]]
    stats: dict[str, dict[str, str]] = field(default_factory=dict)

    def live(self, dead_after_ms: int) -> set[str]:
        """The shelf workers whose heartbeat is at most ``dead_after_ms`` old."""
        return live_workers(self.now_ms, self.workers, dead_after_ms)

    def live_holdings(self, dead_after_ms: int) -> dict[str, dict[str, Any]]:
        """What each live shelf worker holds (a dead worker's holdings are stale)."""
        live = self.live(dead_after_ms)
        return {name: holding for name, holding in self.holdings.items() if name in live}

    def holders(self, dead_after_ms: int, what: str = "held") -> dict[str, set[str]]:
        """Model -> the live workers that have it in their ``what`` list (held, loading, refusing)."""
        found: dict[str, set[str]] = {}
        for name, holding in self.live_holdings(dead_after_ms).items():
            for model in _names(holding.get(what)):
                found.setdefault(model, set()).add(name)
        return found


def _names(value: Any) -> list[str]:
    return [str(name) for name in value] if isinstance(value, list) else []


def read_fleet(client: RedisClient, skeys: ShelfKeys) -> FleetState:
    """The fleet's state in one script (one slot: the shelf's keys share its hash tag)."""
    seconds, micros, beats, holdings, stats = scripts(client).shelf_state(
        keys=[skeys.workers, skeys.holders, skeys.stats])
    return FleetState(server_time_ms((seconds, micros)), parse_workers(_pairs(beats)),
                      _json_values(_pairs(holdings)), parse_stats(_pairs(stats)))


def _pairs(flat: list[Any]) -> dict[bytes, bytes]:
    return dict(zip(flat[::2], flat[1::2], strict=True))


def _json_values(raw: dict[bytes, bytes]) -> dict[str, dict[str, Any]]:
    found = {}
    for name, value in raw.items():
        try:
            decoded = json.loads(value)
        except ValueError:
            continue
        if isinstance(decoded, dict):
            found[name.decode()] = decoded
    return found


def parse_stats(raw: dict[bytes, bytes]) -> dict[str, dict[str, str]]:
    """The stats hash (fields ``<model>:<counter>``) as ``{model: {counter: value}}``."""
    stats: dict[str, dict[str, str]] = {}
    for name, value in raw.items():
        model, _, counter = name.decode().rpartition(":")
        if model:
            stats.setdefault(model, {})[counter] = value.decode()
    return stats


def publish_holdings(client: RedisClient, skeys: ShelfKeys, worker: str, holding: dict[str, Any]) -> None:
    """Record what ``worker`` holds, loads and refuses now (its own line of the holders hash)."""
    pipe = client.pipeline(transaction=False)
    pipe.hset(skeys.holders, worker, json.dumps(holding))
    pipe.expire(skeys.holders, SHELF_TTL_S)
    pipe.execute()


def remove_holdings(client: RedisClient, skeys: ShelfKeys, worker: str) -> None:
    """Remove ``worker``'s line of the holders hash: it holds nothing any more."""
    client.hdel(skeys.holders, worker)


# the load lease --------------------------------------------------------------------------------

def take_lease(client: RedisClient, skeys: ShelfKeys, model: str, worker: str, holders: int, dead_after_ms: int,
               ttl_ms: int) -> bool:
    """Take ``model``'s load lease for ``worker``, unless a live worker has it or the model's live
    holders are no longer ``holders`` (wire/lua/shelf_take_lease.lua)."""
    taken = scripts(client).shelf_take_lease(keys=[skeys.lease(model), skeys.workers, skeys.holders],
                                             args=[worker, model, holders, dead_after_ms, ttl_ms])
    return bool(taken)


def drop_lease(client: RedisClient, skeys: ShelfKeys, model: str, worker: str) -> None:
    """Give ``model``'s load lease back, if ``worker`` still has it."""
    scripts(client).shelf_drop_lease(keys=[skeys.lease(model)], args=[worker])


# counters, measures and events ----------------------------------------------------------------

def record(client: RedisClient, skeys: ShelfKeys, model: str, event: str, worker: str,
           counters: dict[str, float] | None = None, values: dict[str, Any] | None = None,
           detail: dict[str, Any] | None = None) -> None:
    """Record ``event`` of ``model`` (``loaded``, ``evicted``, ``failed``...): add ``counters`` to
    its counters, set its ``values``, and append the event (with the values and ``detail``) to the
    events stream; one pipeline."""
    pipe = client.pipeline(transaction=False)
    for counter, amount in (counters or {}).items():
        if isinstance(amount, int):
            pipe.hincrby(skeys.stats, f"{model}:{counter}", amount)
        else:
            pipe.hincrbyfloat(skeys.stats, f"{model}:{counter}", amount)
    if values:
        pipe.hset(skeys.stats, mapping={f"{model}:{name}": str(value) for name, value in values.items()})
    fields: dict[Any, Any] = {"event": event, "model": model, "worker": worker,
                              **{k: str(v) for k, v in {**(values or {}), **(detail or {})}.items()}}
    pipe.xadd(skeys.events, fields, maxlen=EVENTS_MAX_LEN, approximate=True)
    pipe.expire(skeys.stats, STATS_TTL_S)
    pipe.expire(skeys.events, STATS_TTL_S)
    pipe.execute()


def set_measures(client: RedisClient, skeys: ShelfKeys, model: str, values: dict[str, Any]) -> None:
    """Set measures of ``model`` (its throughput per holder...) without an event."""
    pipe = client.pipeline(transaction=False)
    pipe.hset(skeys.stats, mapping={f"{model}:{name}": str(value) for name, value in values.items()})
    pipe.expire(skeys.stats, STATS_TTL_S)
    pipe.execute()


def clear_failure(client: RedisClient, skeys: ShelfKeys, model: str) -> None:
    """Forget that ``model`` failed to load (it has just loaded)."""
    client.hdel(skeys.stats, f"{model}:failed_until", f"{model}:error")


def read_events(client: RedisClient, skeys: ShelfKeys, count: int = 100) -> list[dict[str, str]]:
    """The newest ``count`` events, oldest first, each with its server time (``at_ms``)."""
    rows = cast(StreamRows, client.xrevrange(skeys.events, count=count))
    events = []
    for entry_id, fields in reversed(rows):
        event = {k.decode(): v.decode() for k, v in fields.items()}
        event["at_ms"] = entry_id.decode().split("-", 1)[0]
        events.append(event)
    return events


# the queue's evidence --------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelQueue:
    """One model's queue at one instant: items not delivered yet, and when (server ms) the oldest of
    them was added (None: none waits); ``now_ms``: its server's time; ``pending``: items delivered
    to a worker and not acked yet."""

    waiting: int
    oldest_ms: int | None
    now_ms: int
    pending: int = 0

    @property
    def oldest_age(self) -> float:
        """Seconds the oldest waiting item has waited (0: none waits)."""
        return 0.0 if self.oldest_ms is None else max(0, self.now_ms - self.oldest_ms) / 1000


def read_queues(client: RedisClient, models: Iterable[str], levels: int) -> dict[str, ModelQueue]:
    """Every model's queue (all its priority levels), by the QUEUE_DEPTHS script: pipelined on one
    server, one call per model on a Cluster (whose pipelines cannot carry scripts)."""
    names = list(models)
    script = scripts(client).queue_depths
    calls = [dict(keys=[key for level in range(levels) for key in Keys(name).level_keys(level)],
                  args=[Keys(name).group]) for name in names]
    if is_cluster(client):
        replies = [script(**call) for call in calls]
    else:
        pipe = client.pipeline(transaction=False)
        for call in calls:
            script(**call, client=pipe)
        replies = pipe.execute()
    return {name: _queue(reply) for name, reply in zip(names, replies, strict=True)}


def _queue(reply: list[Any]) -> ModelQueue:
    now_ms = server_time_ms((reply[0], reply[1]))
    waiting, oldest, delivered = 0, None, 0
    for length, pending, oldest_ms, _held in reply[2:]:
        waiting += max(0, int(length) - int(pending))
        delivered += int(pending)
        if int(oldest_ms) >= 0:
            oldest = int(oldest_ms) if oldest is None else min(oldest, int(oldest_ms))
    return ModelQueue(waiting, oldest, now_ms, delivered)
