"""``rstreamer exporter``: the queue metrics of every prefix on one Redis, for Prometheus.

Workers export what they do (``rstreamer-worker --metrics-port``), but what is waiting, how long it
has waited, how long the backlog will take to drain and whether any worker is alive at all can only
be read from Redis, and must still be reported when every worker is gone: that is this process.
It samples Redis through the dashboard's :class:`~rstreamer.ops.dashboard.sampler.Sampler` (the
snapshots of ``rstreamer status``), once per ``--interval`` whatever the number of scrapes, and
serves the gauges of :class:`~rstreamer.ops.metrics.QueueCollector` on ``/metrics``. It needs
prometheus-client only (no web framework), and binds to 127.0.0.1 unless told otherwise.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from types import FrameType
from typing import NoReturn

DEFAULT_PORT = 9321
DRAIN_TARGET_ENV = "RSTREAMER_DRAIN_TARGET"

logger = logging.getLogger(__name__)


class _Parser(argparse.ArgumentParser):
    """Errors in one line (the usage is one ``--help`` away)."""

    def error(self, message: str) -> NoReturn:
        """Exit 2 with ``message`` on one line."""
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def parser() -> argparse.ArgumentParser:
    """The ``rstreamer exporter`` argument parser."""
    from ..settings import DEFAULT_REDIS_URL, REDIS_URL_ENV, redis_url_from_env

    p = _Parser(prog="rstreamer exporter", description="Serve the queue metrics of the prefixes "
                                "on one Redis (depth, waits, drain time, live workers) for Prometheus.")
    p.add_argument("--redis", metavar="URL", default=redis_url_from_env(),
                   help=f"Redis URL or host:port (env {REDIS_URL_ENV}, default {DEFAULT_REDIS_URL})")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only; "
                   "0.0.0.0 in a container, for a Prometheus elsewhere)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port of /metrics (default {DEFAULT_PORT})")
    p.add_argument("--prefix", action="append", help="export only this prefix (repeatable; default: every prefix "
                   "that has a request stream)")
    p.add_argument("--interval", type=float, default=1.0, metavar="SECONDS", help="seconds between two reads of "
                   "Redis (default 1)")
    p.add_argument("--drain-target", type=float, default=None, metavar="SECONDS",
                   help=f"the drain time the workers are scaled to, exported as rstreamer_queue_drain_target_seconds "
                        f"(env {DRAIN_TARGET_ENV}; default: not exported)")
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parse ``argv``; ``--drain-target`` falls back on RSTREAMER_DRAIN_TARGET. Exits 2 on bad values."""
    from ..settings import env_name, parse_seconds

    p = parser()
    args = p.parse_args(argv)
    if args.drain_target is None:
        raw = os.environ.get(env_name("drain_target"), "")
        if raw:
            try:
                args.drain_target = parse_seconds(raw)
            except ValueError as exc:
                p.error(f"{DRAIN_TARGET_ENV}={raw!r}: {exc}")
    if args.interval <= 0:
        p.error("--interval must be > 0")
    if args.drain_target is not None and not args.drain_target > 0:
        p.error("--drain-target must be > 0")
    if not 0 <= args.port <= 65535:
        p.error(f"--port must be a port number, got {args.port}")
    return args


def main(argv: list[str]) -> int:
    """Serve ``/metrics`` until SIGTERM or Ctrl-C; 2 on a bad setting or a port that cannot be bound."""
    args = parse_args(argv)
    from prometheus_client import CollectorRegistry, start_http_server

    from ..broker.connection import create_redis, normalize_broker_url, redacted
    from ..errors import BrokerUnavailable
    from ..settings import WorkerSettings
    from .dashboard.sampler import Sampler
    from .metrics import QueueCollector

    try:
        url = normalize_broker_url(args.redis)
        client = create_redis(url, socket_timeout=5.0, retries=1)
        sampler = Sampler(client, WorkerSettings.from_env().dead_after, args.interval, 4 * args.interval,
                          args.prefix, dead_letters_shown=0, jobs_shown=0)
    except (ValueError, BrokerUnavailable) as exc:  # ValueError: ConfigError, or one of redis-py's own
        print(f"rstreamer exporter: {exc}", file=sys.stderr)
        return 2
    registry = CollectorRegistry()
    registry.register(QueueCollector(lambda: list(sampler.state()["prefixes"]), lambda: sampler.state()["error"],
                                     args.drain_target))
    # A first sample before /metrics answers (a Redis that does not answer yet is reported, then
    # retried): a scrape in between would read redis_up 0 and no prefix from an exporter that had
    # not looked yet.
    sampler.start()
    try:
        server, _ = start_http_server(args.port, args.host, registry=registry)
    except OSError as exc:
        sampler.stop()
        print(f"rstreamer exporter: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    _stop_on_signals(stop)
    host, port = str(server.server_address[0]), server.server_address[1]
    print(f"rstreamer exporter: http://{host}:{port}/metrics (Redis {redacted(url)}; "
          f"{'prefixes ' + ', '.join(args.prefix) if args.prefix else 'every prefix'})", flush=True)
    try:
        stop.wait()
    finally:
        sampler.stop()
        server.shutdown()
        server.server_close()
        client.close()
    return 0


def _stop_on_signals(stop: threading.Event) -> None:
    def handler(signum: int, frame: FrameType | None) -> None:
        stop.set()  # a flag only: the main thread stops the server

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, handler)
