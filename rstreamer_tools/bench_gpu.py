"""`rstreamer bench gpu`: the checks and figures that need a real GPU, in one run.

CI has no GPU, so what only a GPU shows is checked here, by hand, on a machine that has one. A
private Redis, real ``rstreamer-worker --gpus 0`` processes and callers through ``RedisStreamer``,
with the models of ``workers.gpucheck`` (each tells where it ran). Steps (``--steps``, all by
default):

- ``placement``: two workers of ``--gpus 0 --workers-per-gpu 2`` and two processes of
  ``Streamer(cuda_devices=[0])`` each answer from ``cuda:0`` with ``gpu_id`` 0 and
  ``CUDA_VISIBLE_DEVICES=0``; ``rstreamer status`` shows GPU 0 for both workers.
- ``oom``: items of a twentieth of the GPU's memory each, batch 32: a batch runs out of memory,
  the worker splits it and learns a cap, every item is answered by the same process; an item of
  three times the GPU's memory fails alone, also inside a batch of ordinary ones, and the
  batches after it keep the learned size.
- ``shelf``: one shelf worker, ``--memory-budget`` of 2.5 models, three models of 2 GiB called in
  turn: the live CUDA memory never holds three.
- ``encoder`` and ``sleeper``: a BERT-sized encoder (fp16), and a model that sleeps 4.8 ms a batch,
  called directly in batches of ``--batch-size`` and through Redis by ``--processes`` x
  ``--threads`` callers of one item, served by each number of worker processes on the GPU of
  ``--workers`` in turn (``--workers-per-gpu``): items/s, the ratio to the direct call, p50/p99,
  and a worker's own time between two batches (``gap``) beside the model's (``run``). One
  worker leaves the GPU idle for its gap; a second runs a batch in the first one's gap.

Without a GPU the steps run on the CPU (``oom`` and ``shelf`` are skipped: their figures mean GPU
memory) and say so; ``--small`` shrinks the encoder for that. Prints one JSON object per step
and writes ``bench-gpu.json`` to ``--output``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from rstreamer.broker.embedded import EmbeddedRedis
from rstreamer.client.sync import RedisStreamer
from rstreamer.local import Streamer
from rstreamer.ops.metrics import percentile
from rstreamer.wire.published import wait_for_live_workers
from rstreamer_tools.arguments import positive_counts
from rstreamer_tools.processes import stop_group
from rstreamer_tools.threads import run_threads

MODELS = "workers.gpucheck"
STEPS = ("placement", "oom", "shelf", "encoder", "sleeper")


def _env() -> dict[str, str]:
    """This environment, with the repository (the ``workers`` package) on the path of the workers."""
    path = os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


def _gpu_memory() -> int:
    """The GPU's bytes, 0 without one."""
    import torch

    return int(torch.cuda.get_device_properties(0).total_memory) if torch.cuda.is_available() else 0


@contextlib.contextmanager
def _worker(url: str, *args: str, live: tuple[str, int] | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """``rstreamer-worker --redis url *args`` in a process group of its own; with ``live``
    (prefix, count), once that many workers beat on the prefix."""
    command = [sys.executable, "-c", "from rstreamer.cli import worker_main; worker_main()", "--redis", url,
               "--log-level", "WARNING", *args]
    process = subprocess.Popen(command, env=_env(), start_new_session=True)
    try:
        if live is not None:
            with RedisStreamer(url, live[0]) as streamer:
                wait_for_live_workers(streamer.redis, streamer.keys, live[1], timeout=300)
        yield process
    finally:
        stop_group(process, grace=10)


def _status(url: str, *args: str) -> Any:
    done = subprocess.run([sys.executable, "-c", "from rstreamer.cli import main; main()", "status", "--redis", url,
                           "--json", "--interval", "0", *args], env=_env(), capture_output=True, text=True,
                          timeout=60, check=True)
    return json.loads(done.stdout)


def _placed(where: dict[str, Any], gpu: bool) -> bool:
    """Whether a process answered from GPU 0 alone (without a GPU: was told GPU 0, and runs on the CPU)."""
    device_ok = where["devices"] == 1 and where["device"].startswith("cuda") if gpu else where["device"] == "cpu"
    return bool(where["gpu_id"] == 0 and where["visible"] == "0" and device_ok)


def _two_processes(streamer: RedisStreamer | Streamer) -> dict[int, dict[str, Any]]:
    """Where each process of ``streamer``'s two answered from, by pid (calls until both have)."""
    seen: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + 60
    while len(seen) < 2 and time.monotonic() < deadline:
        for future in [streamer.submit([n]) for n in range(32)]:
            seen.update((where["pid"], where) for where in future.result(60))
    return seen


def placement(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """Two workers on GPU 0, and two local processes of Streamer(cuda_devices=[0])."""
    with _worker(url, "--prefix", "gpu-probe", "--gpus", "0", "--workers-per-gpu", "2", "--batch-size", "4",
                 "--max-latency", "0.01", f"{MODELS}:Probe", live=("gpu-probe", 2)), \
            RedisStreamer(url, "gpu-probe", timeout=60) as streamer:
        seen = _two_processes(streamer)
        gpus = [worker["gpu"] for worker in _status(url, "--prefix", "gpu-probe")["workers"]]
    from workers.gpucheck import Probe

    with Streamer(Probe, batch_size=4, max_latency=0.01, worker_num=2, cuda_devices=[0],
                  wait_for_worker_ready=True) as local_streamer:
        local = _two_processes(local_streamer)
    return {"workers": list(seen.values()), "status_gpus": gpus, "streamer": list(local.values()),
            "ok": len(seen) == 2 and len(local) == 2 and gpus == [0, 0]
            and all(_placed(where, _gpu_memory() > 0) for where in [*seen.values(), *local.values()])}


def oom(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """Real out-of-memory errors: a batch too big, and an item too big for any batch."""
    memory = _gpu_memory()
    if not memory:
        return {"skipped": "no GPU"}
    item = max(1, round(memory / 20 / (1 << 30)))  # GiB: a batch of 32 needs 1.6 times the GPU
    huge = 3 * round(memory / (1 << 30))
    errors: list[str] = []

    def answers(futures: Sequence[Any]) -> list[dict[str, Any]]:
        found = []
        for future in futures:
            try:
                found += future.result(120)
            except Exception as exc:  # noqa: BLE001 - counted, and judged below
                errors.append(f"{type(exc).__name__}: {exc}"[:300])
        return found

    with _worker(url, "--prefix", "gpu-oom", "--gpus", "0", "--batch-size", "32", "--max-latency", "0.05",
                 f"{MODELS}:Gibibytes", live=("gpu-oom", 1)) as worker, \
            RedisStreamer(url, "gpu-oom", timeout=120) as streamer:
        started = time.monotonic()
        first = answers([streamer.submit([item] * 8) for _ in range(8)] + [streamer.submit([huge])])
        seconds = time.monotonic() - started
        answers([streamer.submit([item] * 15 + [huge])] + [streamer.submit([item] * 16) for _ in range(3)])
        after = answers([streamer.submit([item] * 8) for _ in range(8)])
        alive = worker.poll() is None
    pids = {answer["pid"] for answer in first + after}
    return {"item_gib": item, "huge_gib": huge, "answered": len(first), "seconds": round(seconds, 2),
            "batches": sorted({a["batch"] for a in first}), "batches_after_huge": sorted({a["batch"] for a in after}),
            "errors": errors, "processes": len(pids), "alive": alive,
            "ok": len(first) == 64 and len(after) == 64 and len(errors) == 2 and len(pids) == 1 and alive
            and all("out of memory on this item alone" in error for error in errors)
            and max(a["batch"] for a in first) < 32 and max(a["batch"] for a in after) > 1}


def shelf(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """Three 2 GiB models, a budget of 5 GiB: the live CUDA memory never holds three."""
    if not _gpu_memory():
        return {"skipped": "no GPU"}
    names = ["gpu-a", "gpu-b", "gpu-c"]
    spec = {"name": "gpu", "models": {name: {"model": f"{MODELS}:Resident", "init_kwargs": {"gib": 2, "seed": n},
                                             "batch_size": 8, "max_latency": 0.01} for n, name in enumerate(names)}}
    path = Path(args.output) / "shelf-gpu.json"
    path.write_text(json.dumps(spec))
    held: list[tuple[str, float]] = []
    with _worker(url, "--shelf", str(path), "--slots", "8", "--memory-budget", "5GiB", "--gpus", "0"):
        for name in [*names, names[0]]:
            deadline = time.monotonic() + 120
            while True:
                try:
                    with RedisStreamer(url, name, timeout=60) as streamer:
                        answer = streamer.predict([0])[0]
                    break
                except Exception:  # noqa: BLE001 - no live shelf worker yet: try again until the deadline
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.5)
            held.append((name, round(answer["allocated"] / (1 << 30), 2)))
    return {"allocated_gib": held, "ok": max(gib for _, gib in held) <= 5.0}


def _callers(url: str, prefix: str, threads: int, seconds: float, item: Any, results: Any) -> None:
    """``threads`` callers of one item each, for ``seconds``; puts their latencies on ``results``."""
    stop = time.monotonic() + seconds
    latencies: list[float] = []
    with RedisStreamer(url, prefix, timeout=60) as streamer:
        def call() -> None:
            while time.monotonic() < stop:
                started = time.perf_counter()
                streamer.predict([item])
                latencies.append(time.perf_counter() - started)

        run_threads(call, threads)
    results.put(latencies)


def _through_redis(url: str, model: str, init: dict[str, Any], item: Any, direct: Callable[[list[Any]], Any],
                   args: argparse.Namespace) -> dict[str, Any]:
    """The model called directly in full batches, then through each number of workers of
    ``--workers``, then directly again: items/s, the ratio to the direct call (the mean of the
    two), latencies, and a worker's gap and run per batch."""
    before = _direct_rate(direct, item, args)
    rows = [_served(url, model, init, item, workers, args, f"-{run}") for run, workers in enumerate(args.workers)]
    after = _direct_rate(direct, item, args)
    direct_rate = (before + after) / 2
    for row in rows:
        row["ratio"] = round(row["redis_items_s"] / direct_rate, 3)
    # A batch's time in the direct call, beside each worker's run per batch: what the worker's
    # host being busy (callers, Redis) adds to the model itself.
    return {"direct_items_s": round(direct_rate), "direct_before_after": [round(before), round(after)],
            "direct_batch_ms": round(args.batch_size / direct_rate * 1000, 3), "through_redis": rows,
            "ok": all(row["ok"] for row in rows)}


def _direct_rate(direct: Callable[[list[Any]], Any], item: Any, args: argparse.Namespace) -> float:
    """Items/s of the model called in full batches in this process (after three to warm up)."""
    for _ in range(3):
        direct([item] * args.batch_size)
    count, started = 0, time.perf_counter()
    while time.perf_counter() - started < min(3.0, args.seconds):
        direct([item] * args.batch_size)
        count += args.batch_size
    return count / (time.perf_counter() - started)


def _served(url: str, model: str, init: dict[str, Any], item: Any, workers: int, args: argparse.Namespace,
            suffix: str) -> dict[str, Any]:
    """``--processes`` x ``--threads`` callers of one item through ``workers`` worker processes
    on GPU 0, for ``--seconds``, on a prefix of its own (named with ``suffix``)."""
    prefix = f"gpu-{model.split(':')[1].lower()}{suffix}"
    with _worker(url, "--prefix", prefix, "--gpus", "0", "--workers-per-gpu", str(workers),
                 "--batch-size", str(args.batch_size), "--max-latency", "0.01", "--init-kwargs", json.dumps(init),
                 model, live=(prefix, workers)), \
            RedisStreamer(url, prefix, timeout=60) as streamer:
        streamer.predict([item] * args.batch_size)
        context = multiprocessing.get_context("spawn")
        results = context.Queue()
        processes = [context.Process(target=_callers, args=(url, prefix, args.threads, args.seconds, item, results))
                     for _ in range(args.processes)]
        for process in processes:
            process.start()
        latencies = sorted(x for _ in processes for x in results.get(timeout=args.seconds + 300))
        for process in processes:
            process.join(60)
        worker = streamer.predict(["stats"])[0]  # whichever worker answers: each times its own batches
    rate = len(latencies) / args.seconds
    p50, p99 = percentile(latencies, 0.5) or 0.0, percentile(latencies, 0.99) or 0.0
    return {"workers": workers, "redis_items_s": round(rate), "p50_ms": round(p50 * 1000, 1),
            "p99_ms": round(p99 * 1000, 1), "callers": f"{args.processes}x{args.threads}", "worker": worker,
            "ok": rate > 0}


def encoder(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """A BERT-sized encoder (``--small``: a tiny one) directly and through Redis."""
    from workers.gpucheck import Encoder

    init = {"d_model": 64, "layers": 1, "heads": 2} if args.small else {}
    model = Encoder()
    model.init_model(**init)
    item = [(n * 13) % 30000 for n in range(8 if args.small else 128)]
    found = _through_redis(url, f"{MODELS}:Encoder", init, item, model.run, args)
    del model
    return found


def sleeper(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """A model that sleeps 4.8 ms a batch and answers 768 floats an item, directly and through Redis."""
    from workers.gpucheck import Sleeper

    model = Sleeper()
    model.init_model()
    return _through_redis(url, f"{MODELS}:Sleeper", {}, 0, model.run, args)


RUNS: dict[str, Callable[[str, argparse.Namespace], dict[str, Any]]] = {
    "placement": placement, "oom": oom, "shelf": shelf, "encoder": encoder, "sleeper": sleeper}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="rstreamer bench gpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", default=",".join(STEPS), help="comma-separated: " + ",".join(STEPS))
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--processes", type=int, default=4, help="caller processes of the encoder and sleeper steps")
    parser.add_argument("--threads", type=int, default=48, help="caller threads per process")
    parser.add_argument("--seconds", type=float, default=6.0, help="seconds of each load")
    parser.add_argument("--workers", type=positive_counts("workers"), default=[1, 2],
                        help="comma-separated numbers of worker processes on the GPU that serve the encoder and "
                             "sleeper steps, each in turn (default: 1,2; 1,2,1,2 alternates them)")
    parser.add_argument("--small", action="store_true", help="a tiny encoder (for a run without a GPU)")
    parser.add_argument("--output", default="bench-output", help="folder for bench-gpu.json")
    args = parser.parse_args(argv)
    unknown = set(args.steps.split(",")) - set(STEPS)
    if unknown:
        parser.error(f"unknown steps {sorted(unknown)}; choose from {','.join(STEPS)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the steps; print a JSON object per step; 0 unless a step failed or raised."""
    args = parse_args(argv)
    Path(args.output).mkdir(parents=True, exist_ok=True)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # the models live in the repository's `workers` package
    results: dict[str, Any] = {"gpu_bytes": _gpu_memory(), "load_average_before": os.getloadavg()}
    failed = False
    with EmbeddedRedis() as server:
        for step in args.steps.split(","):
            started = time.monotonic()
            try:
                results[step] = RUNS[step](server.url, args)
            except Exception as exc:  # noqa: BLE001 - one step's failure is reported; the others still run
                results[step] = {"error": f"{type(exc).__name__}: {exc}", "ok": False}
            results[step]["seconds"] = round(time.monotonic() - started, 1)
            failed = failed or results[step].get("ok") is False
            print(json.dumps({step: results[step]}, default=str), flush=True)
    results["load_average_after"] = os.getloadavg()
    (Path(args.output) / "bench-gpu.json").write_text(json.dumps(results, indent=1, default=str))
    return 1 if failed else 0
