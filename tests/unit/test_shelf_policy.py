"""Unit tests of the shelf's placement policies (rstreamer.shelf.policy): evidence in, decisions out."""
from __future__ import annotations

import pytest

from rstreamer.settings import ShelfSettings
from rstreamer.shelf.policy import (
    AllResidentPolicy,
    Decision,
    LruPolicy,
    ModelEvidence,
    QueuePolicy,
    Resident,
    WorkerView,
    policy_for,
    shed_to_budget,
)

SETTINGS = ShelfSettings(slots=2, shelf_min_residency=5.0, shelf_residency_factor=3.0, shelf_idle_floor=1.0,
                         shelf_hot_factor=1.0, shelf_starve_after=10.0, shelf_defer=0.5, shelf_default_load=1.0)
QUEUE = QueuePolicy(SETTINGS)


def evidence(*models: ModelEvidence) -> dict[str, ModelEvidence]:
    return {model.name: model for model in models}


def view(*resident: Resident, slots: int = 2, budget: int = 0, peers_with_room: int = 0) -> WorkerView:
    return WorkerView("me", slots, resident, budget, peers_with_room)


def settled(name: str, idle_for: float = 60.0, loaded_for: float = 600.0, size: int | None = None) -> Resident:
    """A model resident for long (past its residency) and idle for ``idle_for`` seconds."""
    return Resident(name, loaded_for, idle_for, size)


def test_a_model_never_called_is_never_loaded():
    models = evidence(ModelEvidence("a"), ModelEvidence("b", holders=frozenset({"peer"})))
    assert QUEUE.decide(view(), models) == Decision()
    assert LruPolicy(SETTINGS).decide(view(), models) == Decision()


def test_a_cold_model_with_waiting_items_is_loaded_into_a_free_slot():
    decision = QUEUE.decide(view(), evidence(ModelEvidence("a", waiting=3, oldest_age=0.1)))
    assert (decision.load, decision.evict, decision.holders) == ("a", (), 0)
    assert decision.reason.startswith("cold")


def test_the_longest_waiting_cold_model_comes_first():
    models = evidence(ModelEvidence("a", waiting=50, oldest_age=1.0), ModelEvidence("b", waiting=1, oldest_age=4.0))
    assert QUEUE.decide(view(), models).load == "b"


def test_a_model_a_peer_is_loading_or_that_failed_is_left_alone():
    models = evidence(ModelEvidence("a", waiting=3, oldest_age=9.0, loading=frozenset({"peer"})),
                      ModelEvidence("b", waiting=3, oldest_age=9.0, failed=True))
    assert QUEUE.decide(view(), models) == Decision()


def test_a_model_held_here_is_not_loaded_again():
    models = evidence(ModelEvidence("a", waiting=300, oldest_age=30.0, holders=frozenset({"me"})))
    assert QUEUE.decide(view(settled("a", idle_for=0)), models) == Decision()


def test_full_slots_evict_the_cheapest_loss_least_recently_served_weighted_by_load_time():
    # Equal load times: the least recently served goes.
    models = evidence(ModelEvidence("new", waiting=1, oldest_age=1.0), ModelEvidence("x"), ModelEvidence("y"))
    decision = QUEUE.decide(view(settled("x", idle_for=30), settled("y", idle_for=90)), models)
    assert (decision.load, decision.evict) == ("new", ("y",))
    # y was idle longer, but takes 20 s to load again: losing x (1 s to load) costs less.
    models["y"] = ModelEvidence("y", load_seconds=20.0)
    assert QUEUE.decide(view(settled("x", idle_for=30), settled("y", idle_for=90)), models).evict == ("x",)


def test_hysteresis_a_model_stays_its_minimum_residency():
    models = evidence(ModelEvidence("new", waiting=1, oldest_age=1.0), ModelEvidence("x", load_seconds=4.0),
                      ModelEvidence("y"))
    # x loaded 8 s ago: its residency is 3 x 4 s = 12 s; y loaded 4.9 s ago: its floor is 5 s.
    resident = (Resident("x", 8.0, 8.0), Resident("y", 4.9, 4.9))
    assert QUEUE.decide(view(*resident), models) == Decision()
    assert QUEUE.decide(view(Resident("x", 12.0, 8.0), Resident("y", 4.9, 4.9)), models).evict == ("x",)


def test_a_model_served_a_moment_ago_is_not_evicted_for_a_fresh_arrival():
    models = evidence(ModelEvidence("new", waiting=1, oldest_age=2.0), ModelEvidence("x"), ModelEvidence("y"))
    assert QUEUE.decide(view(settled("x", idle_for=0.5), settled("y", idle_for=0.2)), models) == Decision()


def test_a_busy_model_keeps_its_only_slot_until_the_waiting_model_starves():
    busy = ModelEvidence("x", waiting=40, oldest_age=0.2, holders=frozenset({"me"}))
    other = ModelEvidence("y", waiting=40, oldest_age=0.1, holders=frozenset({"me"}))
    fresh = evidence(busy, other, ModelEvidence("new", waiting=1, oldest_age=3.0))
    resident = (settled("x", idle_for=0), settled("y", idle_for=0))
    assert QUEUE.decide(view(*resident), fresh) == Decision()
    starving = {**fresh, "new": ModelEvidence("new", waiting=1, oldest_age=10.5)}
    decision = QUEUE.decide(view(*resident), starving)
    assert decision.load == "new" and len(decision.evict) == 1


def test_a_busy_model_that_another_worker_also_holds_gives_its_slot_first():
    shared = ModelEvidence("x", waiting=40, oldest_age=0.2, holders=frozenset({"me", "peer"}))
    alone = ModelEvidence("y", waiting=40, oldest_age=0.2, holders=frozenset({"me"}))
    models = evidence(shared, alone, ModelEvidence("new", waiting=1, oldest_age=0.3))
    decision = QUEUE.decide(view(settled("x", idle_for=0), settled("y", idle_for=0)), models)
    assert (decision.load, decision.evict) == ("new", ("x",))


def test_a_hot_model_gets_a_second_holder_when_its_expected_wait_exceeds_its_load_time():
    # 200 waiting at 50 items/s on one holder: 4 s of wait, against a 2 s load.
    hot = ModelEvidence("h", waiting=200, oldest_age=0.5, holders=frozenset({"peer"}), load_seconds=2.0, rate=50.0)
    decision = QUEUE.decide(view(), evidence(hot))
    assert (decision.load, decision.holders) == ("h", 1)
    assert decision.reason.startswith("hot")
    warm = ModelEvidence("h", waiting=50, oldest_age=0.5, holders=frozenset({"peer"}), load_seconds=2.0, rate=50.0)
    assert QUEUE.decide(view(), evidence(warm)) == Decision()  # 1 s of wait: not worth a 2 s load
    capped = QueuePolicy(ShelfSettings(slots=2, shelf_max_holders=1))
    assert capped.decide(view(), evidence(hot)) == Decision()


def test_a_hot_model_never_takes_a_busy_models_slot():
    hot = ModelEvidence("h", waiting=900, oldest_age=30.0, holders=frozenset({"peer"}), rate=10.0)
    busy = ModelEvidence("x", waiting=5, oldest_age=0.1, holders=frozenset({"me"}))
    idle = ModelEvidence("y")
    assert QUEUE.decide(view(settled("x", idle_for=0), slots=1), evidence(hot, busy)) == Decision()
    assert QUEUE.decide(view(settled("y", idle_for=30), slots=1), evidence(hot, idle)).evict == ("y",)


def test_a_full_worker_leaves_a_fresh_cold_model_to_a_peer_with_a_free_slot():
    models = evidence(ModelEvidence("new", waiting=1, oldest_age=0.2), ModelEvidence("x"), ModelEvidence("y"))
    full = (settled("x"), settled("y"))
    assert QUEUE.decide(view(*full, peers_with_room=1), models) == Decision()
    models["new"] = ModelEvidence("new", waiting=1, oldest_age=0.6)  # the peer did not take it in time
    assert QUEUE.decide(view(*full, peers_with_room=1), models).load == "new"
    models["new"] = ModelEvidence("new", waiting=1, oldest_age=0.2)
    assert QUEUE.decide(view(settled("x"), peers_with_room=1), models).load == "new"  # we have room too


def test_the_memory_budget_counts_measured_sizes():
    models = evidence(ModelEvidence("big", waiting=1, oldest_age=1.0, size=600), ModelEvidence("x"),
                      ModelEvidence("y"))
    resident = (settled("x", idle_for=10, size=300), settled("y", idle_for=20, size=300))
    decision = QUEUE.decide(view(*resident, slots=4, budget=1000), models)
    assert (decision.load, decision.evict) == ("big", ("y",))
    # A model larger than the whole budget still loads, alone.
    models["big"] = ModelEvidence("big", waiting=1, oldest_age=1.0, size=5000)
    assert QUEUE.decide(view(*resident, slots=4, budget=1000), models).evict == ("y", "x")


def test_a_model_never_measured_is_taken_as_large_as_the_largest_known_and_room_is_made_first():
    """Measured on an H100: with a 5 GiB budget holding two models of 2 GiB, a third never loaded
    was loaded first and its peer evicted after (6 GiB resident for a while). Room is made first."""
    models = evidence(ModelEvidence("c", waiting=1, oldest_age=1.0), ModelEvidence("a", size=2000),
                      ModelEvidence("b", size=2000))
    resident = (settled("a", idle_for=10, size=2000), settled("b", idle_for=20, size=2000))
    for policy in (QUEUE, LruPolicy(SETTINGS)):
        decision = policy.decide(view(*resident, slots=8, budget=5000), models)
        assert (decision.load, decision.evict) == ("c", ("b",))
    # Nothing measured yet, or no budget: nothing is assumed.
    assert QUEUE.decide(view(settled("a"), slots=8, budget=5000), evidence(ModelEvidence("c", waiting=1))).evict == ()
    assert QUEUE.decide(view(*resident, slots=8), models).evict == ()


def test_shed_to_budget_evicts_least_recently_served_but_never_the_newest():
    resident = (Resident("a", 100, 50, 400), Resident("b", 100, 90, 400), Resident("new", 1, 1, 400))
    assert shed_to_budget(view(*resident, slots=3, budget=900)) == ("b",)
    assert shed_to_budget(view(*resident, slots=3, budget=300), newest="new") == ("b", "a")
    assert shed_to_budget(view(*resident, slots=3)) == ()


def test_the_lru_baseline_loads_on_arrival_and_evicts_the_least_recently_served():
    lru = LruPolicy(SETTINGS)
    models = evidence(ModelEvidence("new", waiting=1, oldest_age=0.01), ModelEvidence("x", waiting=9),
                      ModelEvidence("y"))
    decision = lru.decide(view(Resident("x", 0.1, 0.0), Resident("y", 0.1, 0.05)), models)
    assert (decision.load, decision.evict) == ("new", ("y",))  # no residency, no idle floor


def test_the_all_resident_ceiling_loads_every_model_called_or_not():
    everything = AllResidentPolicy(ShelfSettings(slots=3, shelf_policy="all"))
    models = evidence(ModelEvidence("a"), ModelEvidence("b", loading=frozenset({"peer"})), ModelEvidence("c"))
    assert everything.decide(view(settled("a"), slots=3), models).load == "c"
    assert everything.decide(view(settled("a"), settled("c"), slots=2), models) == Decision()


@pytest.mark.parametrize(("name", "cls"), [("queue", QueuePolicy), ("lru", LruPolicy), ("all", AllResidentPolicy)])
def test_policy_for(name, cls):
    assert isinstance(policy_for(ShelfSettings(shelf_policy=name, slots=3)), cls)


def test_the_serving_order_is_most_urgent_first():
    models = evidence(ModelEvidence("a", waiting=1, oldest_age=0.1), ModelEvidence("b", waiting=9, oldest_age=2.0),
                      ModelEvidence("c"))
    assert QUEUE.order(view(settled("a"), settled("b"), settled("c"), slots=3), models) == ["b", "a", "c"]


# simulations: one worker, more busy models than slots ------------------------------------------------

def simulate(policy, models: list[str], slots: int, seconds: float, load: float = 1.0, tick: float = 0.25):
    """Every model always has items waiting; a held model is served continuously (its oldest item is
    fresh), an unheld one's oldest item ages from when it lost its slot. Returns (loads, longest wait)."""
    resident: dict[str, float] = {}  # name -> loaded at
    unheld_since = {name: 0.0 for name in models}
    loads, longest, now = 0, 0.0, 0.0
    while now < seconds:
        found = {name: ModelEvidence(name, waiting=10, oldest_age=0.0 if name in resident else now - since,
                                     holders=frozenset({"me"}) if name in resident else frozenset(),
                                     load_seconds=load)
                 for name, since in unheld_since.items()}
        longest = max(longest, *(m.oldest_age for m in found.values()))
        here = tuple(Resident(name, now - at, 0.0) for name, at in resident.items())
        decision = policy.decide(WorkerView("me", slots, here), found)
        if decision.load is not None:
            for victim in decision.evict:
                del resident[victim]
                unheld_since[victim] = now
            now += load  # the loop does nothing else while it loads
            resident[decision.load] = now
            loads += 1
        now += tick
    return loads, longest


def test_two_models_on_one_slot_do_not_thrash():
    queue_loads, queue_wait = simulate(QueuePolicy(SETTINGS), ["a", "b"], slots=1, seconds=120)
    lru_loads, _ = simulate(LruPolicy(SETTINGS), ["a", "b"], slots=1, seconds=120)
    # A slot spends at most 1 / (1 + residency_factor) of its time loading, and turns come at most
    # every min_residency (5 s) once the waiting model starves (10 s): no more than one load per 10 s.
    assert queue_loads <= 120 / SETTINGS.shelf_starve_after + 1
    assert lru_loads > 5 * queue_loads  # the baseline swaps at every tick
    assert queue_wait <= SETTINGS.shelf_starve_after + SETTINGS.shelf_min_residency + 2 * 1.0 + 2 * 0.25


def test_no_busy_model_starves():
    """Five always-busy models on two slots: each one's oldest item waits a bounded time."""
    loads, longest = simulate(QueuePolicy(SETTINGS), ["a", "b", "c", "d", "e"], slots=2, seconds=600)
    # The longest-waiting model goes first; one waits at most for the models ahead of it, each a
    # residency plus a load, spread over the slots.
    bound = SETTINGS.shelf_starve_after + (5 - 2) / 2 * (SETTINGS.shelf_min_residency + 1.0) + 2.0
    assert longest <= bound, (longest, bound)
    assert loads >= 600 / (SETTINGS.shelf_starve_after + SETTINGS.shelf_min_residency + 1.0)


def test_a_starving_model_takes_the_slot_of_the_busy_model_least_in_demand():
    busy = {name: ModelEvidence(name, waiting=2, oldest_age=0.1, holders=frozenset({"me"})) for name in ("x", "y")}
    models = evidence(*busy.values(), ModelEvidence("new", waiting=1, oldest_age=12.0))
    resident = (Resident("x", 600, 0.0, demand=3.0), Resident("y", 600, 0.0, demand=9.0))
    assert QUEUE.decide(view(*resident), models).evict == ("x",)
    resident = (Resident("x", 600, 0.0, demand=30.0), Resident("y", 600, 0.0, demand=9.0))
    assert QUEUE.decide(view(*resident), models).evict == ("y",)
