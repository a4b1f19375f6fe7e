"""How many items per second one Redis core carries for rstreamer (docs/deploy.md, "Capacity").

    python -m rstreamer_tools.capacity --workers 2 --clients 4 --threads 16 --items-per-call 1 --seconds 20

Starts a private redis-server, echo workers and client processes that call ``predict`` back to
back, then reports the items answered per second and, from Redis's own ``INFO cpu`` (main
thread), the CPU seconds Redis spent: items per Redis CPU-second is what one core carries
when Redis, not the clients, is the limit. Run it where the clients and workers have enough
cores to push Redis towards 100 %; on a small machine the per-CPU-second figure is the
meaningful one.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

import redis

from rstreamer import RedisStreamer, RedisWorker
from rstreamer.broker.embedded import EmbeddedRedis
from rstreamer.settings import WorkerSettings
from workers.echo import echo_predict


def run_worker(url: str, prefix: str, batch_size: int) -> None:
    RedisWorker(echo_predict, batch_size, 0.005, url, prefix, settings=WorkerSettings()).run_forever()


def run_client(url: str, prefix: str, threads: int, items_per_call: int, payload: int, seconds: float,
               results: Any) -> None:
    streamer = RedisStreamer(url, prefix, timeout=30)
    item = "x" * payload
    counts = [0] * threads
    stop_at = time.monotonic() + seconds

    def loop(slot: int) -> None:
        while time.monotonic() < stop_at:
            streamer.predict([item] * items_per_call)
            counts[slot] += items_per_call

    pool = [threading.Thread(target=loop, args=(i,)) for i in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    streamer.close()
    results.put(sum(counts))


@dataclass
class RedisUsage:
    cpu_s: float
    commands: int

    @classmethod
    def read(cls, client: redis.Redis) -> RedisUsage:
        cpu = client.info("cpu")
        stats = client.info("stats")
        main = cpu.get("used_cpu_user_main_thread", cpu["used_cpu_user"]) + \
            cpu.get("used_cpu_sys_main_thread", cpu["used_cpu_sys"])
        return cls(float(main), int(stats["total_commands_processed"]))


@dataclass
class Report:
    workers: int
    clients: int
    threads_per_client: int
    items_per_call: int
    payload_bytes: int
    seconds: float
    items: int
    items_per_s: float
    redis_cpu_s: float
    redis_cpu_percent: float
    items_per_redis_cpu_s: float
    redis_commands_per_item: float


def measure(args: argparse.Namespace) -> Report:
    context = multiprocessing.get_context("spawn")
    with EmbeddedRedis() as server:
        prefix = "capacity"
        workers = [context.Process(target=run_worker, args=(server.url, prefix, args.batch_size), daemon=True)
                   for _ in range(args.workers)]
        for process in workers:
            process.start()
        _warm_up(server.url, prefix)
        client = redis.Redis.from_url(server.url)
        results = context.Queue()
        clients = [context.Process(target=run_client, args=(server.url, prefix, args.threads, args.items_per_call,
                                                           args.payload, args.seconds, results))
                   for _ in range(args.clients)]
        before, started = RedisUsage.read(client), time.monotonic()
        for process in clients:
            process.start()
        items = sum(results.get(timeout=args.seconds + 120) for _ in clients)
        elapsed, after = time.monotonic() - started, RedisUsage.read(client)
        for process in clients + workers:
            process.terminate()
            process.join(timeout=10)
        client.close()
    cpu = after.cpu_s - before.cpu_s
    return Report(args.workers, args.clients, args.threads, args.items_per_call, args.payload, round(elapsed, 2),
                  items, round(items / elapsed), round(cpu, 2), round(100 * cpu / elapsed, 1),
                  round(items / cpu) if cpu else 0, round((after.commands - before.commands) / items, 2))


def _warm_up(url: str, prefix: str) -> None:
    with RedisStreamer(url, prefix, timeout=60) as streamer:
        streamer.predict(["warm-up"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--threads", type=int, default=16, help="threads per client process")
    parser.add_argument("--items-per-call", type=int, default=1)
    parser.add_argument("--payload", type=int, default=64, help="bytes per item (a str)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=20.0)
    print(json.dumps(asdict(measure(parser.parse_args()))))


if __name__ == "__main__":
    main()
