"""Placement of a shelf's models on its workers, decided by each worker from the queue's evidence.

Pure (no Redis, no clock): the inputs are what one worker reads at each tick, namely every model's
backlog and oldest wait, its live holders, a load in progress, its measured load time and
throughput (:class:`ModelEvidence`), and this worker's own resident models (:class:`WorkerView`);
the output is a :class:`Decision`: at most one model to load, and the models to evict for it.
Every worker runs the same policy on the same evidence; the fleet-wide load lease (in Redis,
:mod:`rstreamer.wire.shelf`) lets one of them act, and only while the holders it saw are still
the holders. docs/shelf.md explains the rules and their settings.

- :class:`QueuePolicy` (``queue``, the default): a cold model with waiting items is loaded,
  longest-waiting first; a hot one gets one more holder when its expected wait exceeds its load
  time; the resident model whose loss costs least goes (least recently served, weighted by its
  load time), never before its minimum residency (the hysteresis), and a model that waited
  ``shelf_starve_after`` may take the slot of a busy one (no starvation).
- :class:`LruPolicy` (``lru``): load on arrival, plain least-recently-used out: a baseline.
- :class:`AllResidentPolicy` (``all``): every model loaded at once, never evicted: a ceiling.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from ..settings import ShelfSettings


@dataclass(frozen=True)
class ModelEvidence:
    """What the fleet knows of one model at one tick.

    ``waiting``: items not yet delivered to a worker; ``oldest_age``: seconds the oldest of them
    has waited (0: none); ``holders``, ``loading``: the live workers holding it, loading it;
    ``load_seconds``: its measured load time (None: never loaded, nor hinted); ``rate``: items/s
    one holder serves while busy (None: not measured); ``failed``: its ``init_model`` failed
    recently; ``size``: its measured resident bytes (None: not measured).
    """

    name: str
    waiting: int = 0
    oldest_age: float = 0.0
    holders: frozenset[str] = frozenset()
    loading: frozenset[str] = frozenset()
    load_seconds: float | None = None
    rate: float | None = None
    failed: bool = False
    size: int | None = None


@dataclass(frozen=True)
class Resident:
    """A model this worker holds: seconds since its load ended, since it last served an item
    (since its load when it has served none), its measured resident bytes, and the items per
    second it served lately."""

    name: str
    loaded_for: float
    idle_for: float
    size: int | None = None
    demand: float = 0.0


@dataclass(frozen=True)
class WorkerView:
    """This worker: its slots, its resident models, its memory budget (bytes, 0: none), and how many
    live peers have a free slot and no load in progress."""

    name: str
    slots: int
    resident: tuple[Resident, ...] = ()
    memory_budget: int = 0
    peers_with_room: int = 0

    @property
    def held(self) -> frozenset[str]:
        """The names of the resident models."""
        return frozenset(r.name for r in self.resident)


@dataclass(frozen=True)
class Decision:
    """What this worker does now: load ``load`` (None: nothing) after evicting ``evict``.

    ``holders``: the live holders of ``load`` the decision saw; the load lease is taken only if
    they are still the holders (a peer that loaded it meanwhile makes this decision moot).
    """

    load: str | None = None
    evict: tuple[str, ...] = ()
    holders: int = 0
    reason: str = ""


class Policy(Protocol):
    """A placement policy (see the module)."""

    def decide(self, view: WorkerView, evidence: Mapping[str, ModelEvidence]) -> Decision:
        """This worker's decision at this tick."""

    def order(self, view: WorkerView, evidence: Mapping[str, ModelEvidence]) -> list[str]:
        """The order in which this worker serves its resident models (most urgent first)."""


def policy_for(settings: ShelfSettings) -> Policy:
    """The policy ``settings.shelf_policy`` names."""
    policies: dict[str, type[QueuePolicy] | type[LruPolicy] | type[AllResidentPolicy]] = {
        "queue": QueuePolicy, "lru": LruPolicy, "all": AllResidentPolicy}
    return policies[settings.shelf_policy](settings)


def by_urgency(names: Iterable[str], evidence: Mapping[str, ModelEvidence]) -> list[str]:
    """``names`` with the longest-waiting oldest item first (then by name)."""
    return sorted(names, key=lambda name: (-_evidence(name, evidence).oldest_age, name))


def shed_to_budget(view: WorkerView, newest: str | None = None) -> tuple[str, ...]:
    """The resident models to evict, least recently served first, until their measured sizes fit
    the memory budget; never ``newest`` (the model just loaded, which made them not fit)."""
    if not view.memory_budget:
        return ()
    used = sum(r.size or 0 for r in view.resident)
    shed: list[str] = []
    for resident in sorted(view.resident, key=lambda r: (-r.idle_for, r.name)):
        if used <= view.memory_budget:
            break
        if resident.name != newest:
            shed.append(resident.name)
            used -= resident.size or 0
    return tuple(shed)


def _evidence(name: str, evidence: Mapping[str, ModelEvidence]) -> ModelEvidence:
    return evidence.get(name) or ModelEvidence(name)


@dataclass
class _Room:
    """Slots and bytes a load needs, as victims are chosen."""

    slots_short: int
    used: int
    need: int
    budget: int

    def fits(self) -> bool:
        memory_ok = not self.budget or self.used + self.need <= self.budget or self.used == 0
        return self.slots_short <= 0 and memory_ok

    def free(self, size: int | None) -> None:
        self.slots_short -= 1
        self.used -= size or 0


def assumed_size(model: ModelEvidence, view: WorkerView, evidence: Mapping[str, ModelEvidence]) -> int | None:
    """The bytes ``model`` is taken to need under a memory budget: its measured (or hinted) size,
    else the largest size known on the shelf. A model never loaded is taken to be as large as the
    largest one measured, so that room is made before its first load: the load itself does not
    overshoot the budget (on a GPU near full, an overshoot runs out of memory in ``init_model``)."""
    if model.size is not None or not view.memory_budget:
        return model.size
    known = [m.size for m in evidence.values() if m.size] + [r.size for r in view.resident if r.size]
    return max(known, default=None)


def _room(view: WorkerView, need: int | None) -> _Room:
    used = sum(r.size or 0 for r in view.resident)
    return _Room(len(view.resident) + 1 - view.slots, used, need or 0, view.memory_budget)


class QueuePolicy:
    """Placement from the queue's evidence (the default; see the module and docs/shelf.md)."""

    def __init__(self, settings: ShelfSettings) -> None:
        self.settings = settings

    def decide(self, view: WorkerView, evidence: Mapping[str, ModelEvidence]) -> Decision:
        """Load the most urgent wanted model that this worker can make room for."""
        for model, kind in self.wanted(view, evidence):
            victims = self.room_for(model, kind, view, evidence)
            if victims is not None:
                reason = f"{kind}: {model.waiting} waiting, oldest {model.oldest_age:.2f}s"
                return Decision(model.name, victims, len(model.holders), reason)
        return Decision()

    def order(self, view: WorkerView, evidence: Mapping[str, ModelEvidence]) -> list[str]:
        """Resident models, the one whose oldest item has waited longest first."""
        return by_urgency(view.held, evidence)

    def load_time(self, model: ModelEvidence) -> float:
        """The model's measured load time, else the default."""
        return model.load_seconds or self.settings.shelf_default_load

    def expected_wait(self, model: ModelEvidence) -> float:
        """Seconds a new item of ``model`` would wait: its backlog over its holders' measured
        throughput, or (throughput not measured yet) its oldest item's wait."""
        if model.rate and model.holders:
            return model.waiting / (len(model.holders) * model.rate)
        return model.oldest_age

    def min_residency(self, model: ModelEvidence) -> float:
        """Seconds a loaded model stays before it may be evicted (the hysteresis)."""
        return max(self.settings.shelf_min_residency, self.settings.shelf_residency_factor * self.load_time(model))

    def wanted(self, view: WorkerView, evidence: Mapping[str, ModelEvidence]) -> list[tuple[ModelEvidence, str]]:
        """Models this worker could load, most urgent first: cold ones (no live holder) by their
        oldest wait, then hot ones (another holder would pay for its load) by their expected wait."""
        cold: list[ModelEvidence] = []
        hot: list[ModelEvidence] = []
        for model in evidence.values():
            if model.failed or model.waiting <= 0 or model.name in view.held or model.loading:
                continue  # never called (never loaded), ours already, or someone is on it
            if not model.holders:
                if not self._deferred(view, model, evidence):
                    cold.append(model)
            elif self._hot(model):
                hot.append(model)
        cold.sort(key=lambda m: (-m.oldest_age, m.name))
        hot.sort(key=lambda m: (-self.expected_wait(m), m.name))
        return [(m, "cold") for m in cold] + [(m, "hot") for m in hot]

    def _deferred(self, view: WorkerView, model: ModelEvidence, evidence: Mapping[str, ModelEvidence]) -> bool:
        """A worker that would have to evict leaves a fresh cold model to a peer with a free slot."""
        full = not _room(view, assumed_size(model, view, evidence)).fits()
        return full and view.peers_with_room > 0 and model.oldest_age < self.settings.shelf_defer

    def _hot(self, model: ModelEvidence) -> bool:
        most = self.settings.shelf_max_holders or math.inf
        return len(model.holders) < most and (
            self.expected_wait(model) > self.settings.shelf_hot_factor * self.load_time(model))

    def room_for(self, model: ModelEvidence, kind: str, view: WorkerView,
                 evidence: Mapping[str, ModelEvidence]) -> tuple[str, ...] | None:
        """The models to evict so that ``model`` fits (a slot, and the memory budget), cheapest
        loss first; None when the evictable ones are not enough."""
        room = _room(view, assumed_size(model, view, evidence))
        victims: list[str] = []
        for resident in self.victims(model, kind, view, evidence):
            if room.fits():
                break
            victims.append(resident.name)
            room.free(resident.size)
        return tuple(victims) if room.fits() else None

    def victims(self, model: ModelEvidence, kind: str, view: WorkerView,
                evidence: Mapping[str, ModelEvidence]) -> list[Resident]:
        """The resident models ``model`` may displace, cheapest loss first: idle ones, then ones
        another worker also holds, then (for a starving cold model only) busy ones, the least in
        demand first."""
        ranked: list[tuple[int, float, str, Resident]] = []
        for resident in view.resident:
            own = _evidence(resident.name, evidence)
            if resident.loaded_for < self.min_residency(own):
                continue  # the hysteresis: it has not paid for its own load yet
            tier = self._tier(resident, own, model, kind)
            if tier is not None:
                ranked.append((tier, self.keep(resident, own, busy=tier == 2), resident.name, resident))
        return [entry[3] for entry in sorted(ranked, key=lambda entry: entry[:3])]

    def keep(self, resident: Resident, own: ModelEvidence, busy: bool = False) -> float:
        """What losing ``resident`` costs: its load time, discounted by how long it has been idle
        (least recently served, weighted by its load time); for a busy model (which is never
        idle), weighted by the items per second it served lately instead."""
        if busy:
            return self.load_time(own) * resident.demand
        return self.load_time(own) / max(resident.idle_for, 1e-3)

    def _tier(self, resident: Resident, own: ModelEvidence, model: ModelEvidence, kind: str) -> int | None:
        settings = self.settings
        if own.waiting == 0 and resident.idle_for >= settings.shelf_idle_floor:
            return 0  # idle: nothing waits for it
        if kind == "hot":
            return None  # one more holder of a hot model never costs another model its only one
        if own.waiting > 0 and len(own.holders) >= 2:
            return 1  # another holder keeps serving it
        if model.oldest_age >= settings.shelf_starve_after and model.oldest_age > own.oldest_age:
            return 2  # the waiting model starves: the slots take turns
        return None


class LruPolicy:
    """The naive baseline: load a model as soon as items wait for it and nobody holds it; when the
    slots are full, evict the least recently served model (no residency, no second holder)."""

    def __init__(self, settings: ShelfSettings) -> None:
        self.settings = settings

    def decide(self, view: WorkerView, evidence: Mapping[str, ModelEvidence]) -> Decision:
        """Load the longest-waiting unheld model, evicting least recently served ones as needed."""
        arrived = [m for m in evidence.values()
                   if m.waiting > 0 and not m.failed and not m.holders and not m.loading and m.name not in view.held]
        if not arrived:
            return Decision()
        model = max(arrived, key=lambda m: (m.oldest_age, m.name))
        room = _room(view, assumed_size(model, view, evidence))
        victims: list[str] = []
        for resident in sorted(view.resident, key=lambda r: (-r.idle_for, r.name)):
            if room.fits():
                break
            victims.append(resident.name)
            room.free(resident.size)
        return Decision(model.name, tuple(victims), 0, "arrived") if room.fits() else Decision()

    def order(self, view: WorkerView, evidence: Mapping[str, ModelEvidence]) -> list[str]:
        """Resident models by urgency, as the queue policy."""
        return by_urgency(view.held, evidence)


class AllResidentPolicy:
    """The ceiling: every model of the shelf loaded on every worker, called or not, never evicted."""

    def __init__(self, settings: ShelfSettings) -> None:
        self.settings = settings

    def decide(self, view: WorkerView, evidence: Mapping[str, ModelEvidence]) -> Decision:
        """Load the next model this worker does not hold yet, while it has a free slot."""
        if len(view.resident) >= view.slots:
            return Decision()
        for name in sorted(evidence):
            model = evidence[name]
            if name not in view.held and not model.failed and not model.loading:
                return Decision(name, (), len(model.holders), "all resident")
        return Decision()

    def order(self, view: WorkerView, evidence: Mapping[str, ModelEvidence]) -> list[str]:
        """Resident models by urgency, as the queue policy."""
        return by_urgency(view.held, evidence)
