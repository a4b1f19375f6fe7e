"""Shelf workers against a real Redis: models loaded on demand and evicted, with real worker processes."""
from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rstreamer import RedisStreamer
from rstreamer.broker.connection import create_redis
from rstreamer.cli import status_main, worker_main
from rstreamer.errors import RemoteError
from rstreamer.wire.keys import Keys, ShelfKeys
from rstreamer.wire.shelf import read_events, read_fleet
from support.keyleaks import leaked_keys
from support.polling import wait_until
from support.procs import WorkerProcesses

# Fast placement for tests: a tick of 50 ms, short residencies and waits.
FAST = {"slots": 1, "shelf_tick": 0.05, "shelf_min_residency": 0.5, "shelf_residency_factor": 1.0,
        "shelf_idle_floor": 0.2, "shelf_starve_after": 1.0, "shelf_defer": 0.2, "shelf_failed_for": 30.0}
# A worker is dead after 4 s without a heartbeat: this shared machine stalls every process for
# a second or two at times, and a live worker that looks dead loses its load lease.
SETTINGS = {"dead_after": 4.0, "heartbeat_interval": 0.25, "reclaim_interval": 0.25}
DEAD_AFTER_MS = 4000


class Shelf:
    """One test's shelf: its name, models ``<prefix>-<x>`` and the worker processes serving it."""

    def __init__(self, url: str, prefix: str, workers: WorkerProcesses, tmp: Path) -> None:
        self.url = url
        self.name = f"{prefix}-shelf"
        self.prefix = prefix
        self.workers = workers
        self.tmp = tmp
        self.client = create_redis(url)

    def model(self, x: str) -> str:
        return f"{self.prefix}-{x}"

    def log(self, x: str) -> Path:
        return self.tmp / f"{x}.log"

    def spec(self, **models: dict[str, Any]) -> dict[str, Any]:
        """A shelf of ``support.models:Tagged`` models, one per keyword (its extra init kwargs)."""
        return {"name": self.name, "models": {self.model(x): {
            "model": "support.models:Tagged", "batch_size": 8, "max_latency": 0.01,
            "init_kwargs": {"tag": x, "log": str(self.log(x)), **extra}} for x, extra in models.items()}}

    def start(self, spec: dict[str, Any], count: int = 1, **placement: Any) -> list[subprocess.Popen[bytes]]:
        procs = [self.workers.start(self.prefix, wait=False, shelf=spec, shelf_settings={**FAST, **placement},
                                    settings=SETTINGS, log_level="INFO", log_path=self.tmp / f"worker{n}.log")
                 for n in range(count)]
        wait_until(lambda: len(self.live()) >= count, 60, what=f"{count} shelf workers")
        return procs

    def fleet(self) -> Any:
        return read_fleet(self.client, ShelfKeys(self.name))

    def live(self) -> set[str]:
        return self.fleet().live(DEAD_AFTER_MS)

    def holders(self, x: str, what: str = "held") -> set[str]:
        return self.fleet().holders(DEAD_AFTER_MS, what).get(self.model(x), set())

    def events(self, kind: str, x: str | None = None) -> list[dict[str, str]]:
        found = read_events(self.client, ShelfKeys(self.name), 2000)
        return [e for e in found if e["event"] == kind and (x is None or e["model"] == self.model(x))]

    def ran(self, x: str) -> Counter[str]:
        """How many times each item of model ``x`` was run."""
        path = self.log(x)
        return Counter(line.split(" ", 2)[2] for line in path.read_text().splitlines()) if path.exists() else Counter()


@pytest.fixture
def shelf(redis_url: str, prefix: str, workers: WorkerProcesses, tmp_path: Path) -> Iterator[Shelf]:
    found = Shelf(redis_url, prefix, workers, tmp_path)
    yield found
    workers.stop_all()
    found.client.close()
    leaked = leaked_keys(redis_url, f"shelf:{found.name}")
    assert not leaked, f"shelf keys left without a TTL: {leaked}"


def predict(url: str, model: str, items: list[Any], timeout: float = 60) -> list[Any]:
    with RedisStreamer(url, model, timeout=timeout) as streamer:
        return list(streamer.predict(items))


def test_a_cold_model_is_loaded_on_its_first_call_and_answers_it(shelf):
    shelf.start(shelf.spec(a={}, b={}), slots=2)
    assert shelf.holders("a") == set()
    answers = predict(shelf.url, shelf.model("a"), [1, 2, 3])
    assert [tag for tag, _, _ in answers] == ["a"] * 3 and [out for _, _, out in answers] == [2, 4, 6]
    assert len(shelf.holders("a")) == 1
    assert shelf.holders("b") == set()  # never called: never loaded
    assert len(shelf.events("loaded", "a")) == 1 and not shelf.events("loaded", "b")
    assert predict(shelf.url, shelf.model("a"), [5])[0][2] == 10  # held now: no second load
    assert len(shelf.events("loaded", "a")) == 1


def test_an_evicted_model_is_gone_when_its_successor_answers(shelf):
    """An evicted model lets go of its memory at once (on a GPU, its tensors): a worker of one slot
    that swapped models holds one model object, not two until the garbage collector runs."""
    spec = shelf.spec(a={}, b={})
    for model in spec["models"].values():
        model["model"] = "support.models:CountedTagged"
    shelf.start(spec)
    for x in "aba":
        tag, alive, doubled = predict(shelf.url, shelf.model(x), [4])[0]
        assert (tag, doubled) == (x, 8)
        assert alive == 1, f"{alive} models of one slot alive when {x!r} answered"
    assert len(shelf.events("evicted")) == 2


@pytest.mark.timeout(180)
def test_a_model_is_never_served_by_a_worker_that_does_not_hold_it(shelf):
    shelf.start(shelf.spec(a={}, b={}, c={}), count=2)  # 2 workers x 1 slot, 3 models: they swap
    for round_ in range(3):
        threads = [threading.Thread(target=predict, args=(shelf.url, shelf.model(x), list(range(round_ * 10,
                                                                                           round_ * 10 + 5))))
                   for x in "abc"]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    loaded_by: dict[str, set[str]] = {}
    for event in shelf.events("loaded"):
        loaded_by.setdefault(event["model"], set()).add(event["worker"])
    pids = {name: int(name.split(":")[1]) for names in loaded_by.values() for name in names}
    for x in "abc":
        runs = [line.split(" ") for line in shelf.log(x).read_text().splitlines()]
        served_by = {int(pid) for _, pid, _ in runs}
        assert served_by <= {pids[name] for name in loaded_by[shelf.model(x)]}, x
        consumers = {c["name"].decode() for c in shelf.client.xinfo_consumers(Keys(shelf.model(x)).requests,
                                                                              "workers")}
        assert consumers <= loaded_by[shelf.model(x)], x  # nobody else ever read its stream
        assert all(count == 1 for count in shelf.ran(x).values()), shelf.ran(x)


@pytest.mark.timeout(180)
def test_eviction_drains_first_no_item_lost_none_run_twice(shelf):
    """One slot, two busy models batched by cost (so the worker holds items it read ahead): the
    worker takes turns, and each turn ends with a drain of what it read."""
    spec = shelf.spec(a={"delay": 0.02}, b={"delay": 0.02})
    for model in spec["models"].values():
        model.update({"model": "support.models:CostedTagged", "max_batch_cost": 12})
    shelf.start(spec)
    results: dict[str, list[Any]] = {}

    def flood(x: str) -> None:
        with RedisStreamer(shelf.url, shelf.model(x), timeout=120) as streamer:
            futures = [streamer.submit(list(range(n * 10, n * 10 + 10))) for n in range(30)]
            results[x] = [out for future in futures for _, _, out in future.result()]

    threads = [threading.Thread(target=flood, args=(x,)) for x in "ab"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(180)
    for x in "ab":
        assert results[x] == [2 * n for n in range(300)], x
        ran = shelf.ran(x)
        assert len(ran) == 300 and set(ran.values()) == {1}, (x, [i for i, c in ran.items() if c != 1])
    evictions = shelf.events("evicted")
    assert evictions, "the two models should have taken turns on the one slot"
    assert [e["left_pending"] for e in evictions] == ["0"] * len(evictions)  # nothing left behind
    assert sum(int(e["drained"]) for e in evictions) > 0  # what it held was run before the unload


@pytest.mark.timeout(180)
def test_a_worker_killed_mid_load_loses_nothing(shelf):
    procs = shelf.start(shelf.spec(slow={"load_delay": 4.0}), count=2)
    by_pid = {proc.pid: proc for proc in procs}
    answers: list[Any] = []
    caller = threading.Thread(target=lambda: answers.extend(predict(shelf.url, shelf.model("slow"), [1, 2, 3], 90)))
    caller.start()
    loader = wait_until(lambda: shelf.holders("slow", "loading"), 30, what="a worker loading the model")
    (name,) = loader
    os.killpg(by_pid[int(name.split(":")[1])].pid, signal.SIGKILL)  # the worker and its heartbeat process
    caller.join(90)
    assert [out for _, _, out in answers] == [2, 4, 6]
    assert {pid for _, pid, _ in answers} != {int(name.split(":")[1])}
    assert set(shelf.ran("slow").values()) == {1}
    assert [e["worker"] for e in shelf.events("loaded", "slow")] != [name]


def test_two_workers_never_load_one_cold_model_for_one_waiting_item(shelf):
    procs = shelf.start(shelf.spec(a={"load_delay": 1.0}, b={"load_delay": 1.0}, c={"load_delay": 1.0}), count=2,
                        slots=3)
    for x in "abc":
        # Both workers stopped while the item arrives, then resumed together: both see it waiting and
        # no holder at their next tick, and decide to load it at the same instant.
        for proc in procs:
            os.kill(proc.pid, signal.SIGSTOP)
        with RedisStreamer(shelf.url, shelf.model(x), timeout=60) as streamer:
            future = streamer.submit([7])
            time.sleep(0.3)  # past a tick: both are due to place as soon as they run
            for proc in procs:
                os.kill(proc.pid, signal.SIGCONT)
            assert future.result()[0][2] == 14
        assert len(shelf.events("loaded", x)) == 1, x
        assert len(shelf.holders(x)) == 1, x


def test_a_model_whose_init_fails_is_marked_failed_and_the_fleet_goes_on(shelf, capsys):
    shelf.start(shelf.spec(bad={"fail": True}, good={}))
    started = time.monotonic()
    with pytest.raises(RemoteError, match=r"ModelLoadFailed.*failed to load: FileNotFoundError: no weights for bad"):
        predict(shelf.url, shelf.model("bad"), [1], timeout=60)
    assert time.monotonic() - started < 30
    # The next call is refused at once, without another try at loading it.
    started = time.monotonic()
    with pytest.raises(RemoteError, match="ModelLoadFailed"):
        predict(shelf.url, shelf.model("bad"), [2], timeout=60)
    assert time.monotonic() - started < 5
    assert len(shelf.events("failed", "bad")) == 1
    assert predict(shelf.url, shelf.model("good"), [4])[0][2] == 8  # the worker serves the others
    assert status_main(["--redis", shelf.url, "--shelf", shelf.name, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    (bad,) = [row for row in report["models"] if row["model"] == shelf.model("bad")]
    assert "FileNotFoundError: no weights for bad" in bad["error"] and bad["failures"] == 1


def test_status_shows_each_workers_models_and_each_models_loads(shelf, capsys):
    shelf.start(shelf.spec(a={}, b={}), slots=2)
    predict(shelf.url, shelf.model("a"), [1])

    def shown() -> dict[str, Any] | None:
        assert status_main(["--redis", shelf.url, "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        (found,) = [s for s in report["shelves"] if s["shelf"] == shelf.name]
        return found if found["workers"][0]["loads"] else None  # the heartbeat after the load

    found = wait_until(shown, 10, what="the load in the worker's heartbeat")
    (worker,) = found["workers"]
    assert worker["held"] == [shelf.model("a")] and worker["slots"] == 2 and worker["loads"] == 1
    rows = {row["model"]: row for row in found["models"]}
    assert rows[shelf.model("a")]["holders"] == [worker["name"]] and rows[shelf.model("a")]["loads"] == 1
    assert rows[shelf.model("a")]["load_s"] is not None
    assert rows[shelf.model("b")]["holders"] == [] and rows[shelf.model("b")]["loads"] == 0
    assert status_main(["--redis", shelf.url, "--shelf", shelf.name]) == 0
    text = capsys.readouterr().out
    assert f"holds {shelf.model('a')}" in text and "LOAD_S" in text
    assert status_main(["--redis", shelf.url, "--shelf", "no-such-shelf"]) == 1
    assert "unknown" in capsys.readouterr().err


def test_a_misspelt_model_in_the_shelf_file_stops_the_command_at_once(tmp_path, capsys, redis_url):
    path = tmp_path / "shelf.json"
    path.write_text(json.dumps({"models": {"ok": {"model": "support.models:Tagged"},
                                           "typo": {"model": "support.models:Taged"}}}))
    assert worker_main(["--shelf", str(path), "--redis", redis_url]) == 2
    err = capsys.readouterr().err
    assert "model 'typo': field 'model'" in err and "did you mean 'Tagged'" in err
    path.write_text(json.dumps({"models": {"ok": {"model": "support.models:Tagged", "batch_size": 0}}}))
    assert worker_main(["--shelf", str(path), "--redis", redis_url]) == 2
    assert "model 'ok': field 'batch_size': must be an integer >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("server_kind", ["gunicorn", "uvicorn"])
def test_web_apps_serve_a_cold_shelf_model_and_refuse_a_misspelt_one_at_once(shelf, web, server_kind):
    shelf.start(shelf.spec(a={"load_delay": 1.0}))
    cold = getattr(web, server_kind)(shelf.model("a"), RSTREAMER_TIMEOUT="60")
    assert cold.client.get("/readyz").status_code == 200  # a live shelf worker can load it
    response = cold.predict([21])
    assert response.status_code == 200, response.text
    assert response.json()["outputs"][0][2] == 42
    misspelt = getattr(web, server_kind)(shelf.model("aa"), RSTREAMER_TIMEOUT="60")
    started = time.monotonic()
    refused = misspelt.predict([1])
    assert refused.status_code == 503 and refused.json()["error"]["type"] == "NoLiveWorker"
    assert time.monotonic() - started < 5


def test_the_dashboard_shows_each_workers_models_and_each_models_loads(shelf):
    from starlette.testclient import TestClient

    from rstreamer.ops.dashboard.app import Options, create_app
    from rstreamer.ops.dashboard.sampler import Sampler
    from rstreamer.ops.shelves import dashboard_shelves

    shelf.start(shelf.spec(a={}, b={}), slots=2)
    predict(shelf.url, shelf.model("a"), [1])
    sampler = Sampler(shelf.client, dead_after=4.0, interval=0.2, window=2.0, prefixes=[shelf.model("a")],
                      shelf=functools.partial(dashboard_shelves, dead_after=4.0))
    try:
        def shown() -> dict[str, Any] | None:
            sampler.sample()
            client = TestClient(create_app(sampler, Options(allowed_hosts=("testserver",))))
            state = client.get("/api/state").json()
            (found,) = [s for s in state["shelf"] if s["shelf"] == shelf.name]
            return found if found["workers"] and found["workers"][0]["held"] else None

        found = wait_until(shown, 10, what="the shelf on the dashboard")
    finally:
        sampler.stop()
    assert found["workers"][0]["held"] == [shelf.model("a")]
    rows = {row["model"]: row for row in found["models"]}
    assert rows[shelf.model("a")]["loads"] == 1 and len(rows[shelf.model("a")]["holders"]) == 1
    assert rows[shelf.model("b")]["holders"] == [] and rows[shelf.model("b")]["backlog"] == 0


@pytest.mark.timeout(180)
def test_a_holder_killed_while_it_serves_loses_nothing(shelf):
    """Its entries stay pending on the model's stream; the model's next holder reclaims them."""
    procs = shelf.start(shelf.spec(slow={"delay": 3.0}), count=2)
    by_pid = {proc.pid: proc for proc in procs}
    answers: list[Any] = []
    caller = threading.Thread(target=lambda: answers.extend(predict(shelf.url, shelf.model("slow"), [1, 2, 3], 90)))
    caller.start()
    stream = Keys(shelf.model("slow")).requests
    pending = wait_until(lambda: shelf.client.xpending(stream, "workers")["pending"] == 3 and
                         shelf.client.xpending(stream, "workers"), 30, what="the batch running",
                         retry_on=(Exception,))
    ((holder, _),) = [(c["name"].decode(), c["pending"]) for c in pending["consumers"]]
    os.killpg(by_pid[int(holder.split(":")[1])].pid, signal.SIGKILL)
    caller.join(90)
    assert [out for _, _, out in answers] == [2, 4, 6]
    assert {pid for _, pid, _ in answers} != {int(holder.split(":")[1])}
    assert set(shelf.ran("slow").values()) == {1}  # killed before its model finished: run once, by the next


@pytest.mark.parametrize("server_kind", ["gunicorn", "uvicorn"])
def test_the_openai_api_lists_and_serves_a_cold_shelf_model(shelf, web, server_kind):
    spec = {"name": shelf.name, "models": {shelf.model("vec"): {"model": "support.models:TextLengths",
                                                               "init_kwargs": {"load_delay": 1.0}}}}
    shelf.start(spec)
    server = getattr(web, server_kind)(shelf.model("vec"), RSTREAMER_TIMEOUT="60")
    listed = server.client.get("/v1/models").json()
    assert shelf.model("vec") in {model["id"] for model in listed["data"]}  # called or not
    answer = server.client.post("/v1/embeddings", json={"model": shelf.model("vec"), "input": ["abc", "hello"],
                                                        "encoding_format": "float"})
    assert answer.status_code == 200, answer.text
    assert [row["embedding"] for row in answer.json()["data"]] == [[3.0, 1.0], [5.0, 1.0]]
    misspelt = server.client.post("/v1/embeddings", json={"model": shelf.model("vex"), "input": "abc"})
    assert misspelt.status_code == 404 and misspelt.json()["error"]["code"] == "model_not_found"
