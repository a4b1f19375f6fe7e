"""``rstreamer dashboard``: a live page of every prefix: queue, latency and queue wait, batches,
priority levels, drain time, workers (restarts included), jobs and dead letters.

It reads Redis the way ``rstreamer status`` does (no Prometheus needed), serves one static page
with plain JavaScript that updates in place (no build step, no third-party script to vet or vendor:
a few tables and SVG sparklines do not need a framework), and is read-only and bound to 127.0.0.1
unless told otherwise.
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import socket
import sys

DEFAULT_PORT = 8700
ALLOWED_HOSTS_ENV = "RSTREAMER_DASHBOARD_ALLOWED_HOSTS"
WILDCARDS = ("0.0.0.0", "::", "")


def parser() -> argparse.ArgumentParser:
    """The ``rstreamer dashboard`` argument parser."""
    from ...settings import DEFAULT_REDIS_URL, REDIS_URL_ENV, redis_url_from_env

    p = argparse.ArgumentParser(prog="rstreamer dashboard", description="Serve a live dashboard of the prefixes "
                                "on one Redis: queues, latency, batches, levels, workers, jobs, dead letters.")
    p.add_argument("--redis", metavar="URL", default=redis_url_from_env(),
                   help=f"Redis URL or host:port (env {REDIS_URL_ENV}, default {DEFAULT_REDIS_URL})")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--allowed-host", action="append", metavar="NAME",
                   default=[name for name in os.environ.get(ALLOWED_HOSTS_ENV, "").split(",") if name.strip()],
                   help="a host name the page may be reached under besides this machine's own names and "
                        f"addresses (repeatable; env {ALLOWED_HOSTS_ENV}, comma-separated); requests naming "
                        "any other Host are refused (421), so a DNS-rebinding page cannot act as same-origin")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0: any free one)")
    p.add_argument("--prefix", action="append", help="show only this prefix (repeatable; default: every prefix)")
    p.add_argument("--interval", type=float, default=1.0, metavar="SECONDS", help="seconds between samples "
                   "(default 1)")
    p.add_argument("--window", type=float, default=300.0, metavar="SECONDS", help="seconds of history in the "
                   "sparklines (default 300)")
    p.add_argument("--allow-actions", action="store_true", help="show replay and purge buttons for dead letters "
                   "(default: read-only)")
    p.add_argument("--replay-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="deadline given to a replayed item (default 60)")
    return p


def main(argv: list[str]) -> int:
    """Run the dashboard until interrupted."""
    args = parser().parse_args(argv)
    if args.interval <= 0 or args.window < args.interval:
        print("rstreamer dashboard: --interval must be > 0 and --window >= --interval", file=sys.stderr)
        return 2
    if importlib.util.find_spec("uvicorn") is None or importlib.util.find_spec("starlette") is None:
        print("rstreamer dashboard: needs starlette and uvicorn (the webapp extra): pip install starlette uvicorn",
              file=sys.stderr)
        return 2
    try:
        sock = socket.create_server((args.host, args.port))  # bound first, so the URL names the real port
    except OSError as exc:
        print(f"rstreamer dashboard: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 2
    with sock:
        return _serve(args, sock)


def _serve(args: argparse.Namespace, sock: socket.socket) -> int:
    import uvicorn

    from ...broker.connection import create_redis, normalize_broker_url, redacted
    from ...errors import BrokerUnavailable
    from ...settings import WorkerSettings
    from ..shelves import dashboard_shelves
    from .app import Options, create_app
    from .sampler import Sampler

    try:
        url = normalize_broker_url(args.redis)
        client = create_redis(url, socket_timeout=5.0, retries=1)
        dead_after = WorkerSettings.from_env().dead_after
        sampler = Sampler(client, dead_after, args.interval, args.window, args.prefix,
                          shelf=functools.partial(dashboard_shelves, dead_after=dead_after))
    except (ValueError, BrokerUnavailable) as exc:  # ValueError: ConfigError, or one of redis-py's own
        print(f"rstreamer dashboard: {exc}", file=sys.stderr)
        return 2
    app = create_app(sampler.start(), Options(args.allow_actions, args.replay_timeout, *_hosts(args)))
    host, port = sock.getsockname()[:2]
    mode = "actions allowed" if args.allow_actions else "read-only"
    print(f"rstreamer dashboard: http://{host}:{port}/ ({mode}; Redis {redacted(url)})", flush=True)
    try:
        uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
    except KeyboardInterrupt:
        pass  # uvicorn re-raises the Ctrl-C it handled: a normal way to stop
    finally:
        sampler.stop()
        client.close()
    return 0


def _hosts(args: argparse.Namespace) -> tuple[tuple[str, ...], bool]:
    """The names a request's Host may give, and whether any IP address is accepted: loopback, the
    bound address, ``--allowed-host``; bound to every address, this machine's names as well."""
    from .app import LOOPBACK_NAMES

    names = [*LOOPBACK_NAMES, args.host, *(name.strip() for name in args.allowed_host)]
    any_address = args.host in WILDCARDS
    if any_address:
        names += [socket.gethostname(), socket.getfqdn()]
    return tuple(dict.fromkeys(name for name in names if name)), any_address
