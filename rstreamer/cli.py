"""Command-line entry points: ``rstreamer`` (demo, status, bench, worker) and ``rstreamer-worker``.

Every ``rstreamer-worker`` option also comes from an ``RSTREAMER_*`` variable; priority is
command line, then environment, then default. Logging is configured here (rstreamer.ops.logs), and in
the child processes' own entry points; nowhere else.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import sys
import urllib.parse
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, NoReturn

from .errors import BrokerUnavailable, ConfigError
from .model.managed import import_from_working_directory
from .ops.logs import configure_logging
from .settings import (
    DEFAULT_REDIS_URL,
    REDIS_URL_ENV,
    ShelfSettings,
    WebhookSettings,
    WorkerSettings,
    env_name,
    parse_integer,
    parse_seconds,
    setting_parser,
)
from .version import VERSION

USAGE = """usage: rstreamer COMMAND [options]    (rstreamer --version: the installed version)

commands:
  status   queue depth, pending and dead letters, live workers and throughput (--help for options)
  demo     embedded Redis, 2 embedding workers, the web app under gunicorn, real HTTP load, what it batched
  bench    every transport side by side (bench cost: cost-aware batching; bench jobs: durable jobs;
           bench stream: continuous batching and streaming; bench llm: the same with a real chat model;
           bench priority: levels, cancellation, quotas; bench shelf: many models on a few workers;
           bench hotpath: CPU and Redis commands per item, idle lanes;
           bench instructions: Redis's instructions per item, callgrind; bench gpu: on a GPU)
  dashboard  live page of queues, workers and dead letters (--help for options)
  exporter   queue metrics of every prefix (depth, waits, drain time, live workers) for Prometheus
  chaos    load a prefix while SIGKILLing random workers; prints sent/answered/wrong/lost
  jobs     durable jobs: list, show, cancel, purge (--help for options)
  dead     dead letters: list, show, replay, purge (--help for options)
  forget   delete every key of a prefix nobody serves any more (--help for options)
  worker   the same as rstreamer-worker
"""

WORKER_DEFAULTS: dict[str, Any] = {
    "redis": DEFAULT_REDIS_URL,
    "prefix": None,
    "gpus": [],
    "workers_per_gpu": 1,
    "batch_size": WorkerSettings.batch_size,
    "max_latency": WorkerSettings.max_latency,
    "init_args": [],
    "init_kwargs": {},
    "metrics_port": None,
    "metrics_host": "127.0.0.1",
    "log_level": "INFO",
    "log_interval": 10.0,
    "max_restarts": 5,
    "wait_for_redis": 0.0,
    "max_batch_cost": WorkerSettings.max_batch_cost,
    "cost_model": WorkerSettings.cost_model,
    "priorities": WorkerSettings.priorities,
    "level_max_queue": WorkerSettings.level_max_queue,
    "tenant_rate": WorkerSettings.tenant_rate,
    "tenant_burst": WorkerSettings.tenant_burst,
    "tenant_quotas": WorkerSettings.tenant_quotas,
    "tenant_sharing": WorkerSettings.tenant_sharing,
    "webhook_allow": WebhookSettings.webhook_allow,
    "shelf": None,
    "slots": ShelfSettings.slots,
    "memory_budget": ShelfSettings.memory_budget,
    "shelf_policy": ShelfSettings.shelf_policy,
    "model": None,
}

# option dest -> environment variable: RSTREAMER_<DEST>, but --redis reads RSTREAMER_REDIS_URL
WORKER_ENV = {dest: REDIS_URL_ENV if dest == "redis" else env_name(dest) for dest in WORKER_DEFAULTS}

# Options that are WorkerSettings fields: their text has the settings' own parser.
SETTINGS_OPTIONS = ("batch_size", "max_latency", "max_batch_cost", "cost_model", "priorities", "level_max_queue",
                    "tenant_rate", "tenant_burst", "tenant_quotas", "tenant_sharing")
# Options that are ShelfSettings fields.
SHELF_OPTIONS = ("slots", "memory_budget", "shelf_policy")


# value parsers: shared by the command line and the environment -------------------------

def _option(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` for argparse, which shows the message of an ArgumentTypeError only."""
    def option(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    option.__name__ = getattr(parse, "__name__", "value")
    return option


def _integer(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    return _option(parse_integer(minimum, maximum))


_seconds = _option(parse_seconds)


def _json_of(kind: type) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = json.loads(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"not valid JSON ({exc})") from None
        if not isinstance(value, kind):
            raise argparse.ArgumentTypeError(f"must be a JSON {'array' if kind is list else 'object'}")
        return value
    return parse


def _gpus(text: str) -> list[int]:
    from .worker.placement import parse_gpus

    try:
        gpus = parse_gpus(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if any(gpu < 0 for gpu in gpus):
        raise argparse.ArgumentTypeError(f"GPU ids must be >= 0, got {text!r}")
    return gpus


def _host(text: str) -> str:
    host = text.strip().strip("[]")
    if not host or any(c.isspace() or c in "/@?#" for c in host):
        raise argparse.ArgumentTypeError(f"expected an address or host name to bind, e.g. 0.0.0.0, got {text!r}")
    return host


def _log_level(text: str) -> str:
    level = text.strip().upper()
    if not isinstance(logging.getLevelName(level), int):
        raise argparse.ArgumentTypeError(f"unknown log level {text!r} (DEBUG, INFO, WARNING, ERROR)")
    return level


WORKER_PARSERS: dict[str, Callable[[str], Any]] = {
    "redis": str, "prefix": str, "model": str, "gpus": _gpus,
    "workers_per_gpu": _integer(1), "init_args": _json_of(list), "init_kwargs": _json_of(dict),
    "metrics_port": _integer(1, 65535), "metrics_host": _host, "log_level": _log_level, "log_interval": _seconds,
    "max_restarts": _integer(0), "wait_for_redis": _seconds,
    **{dest: _option(setting_parser(WorkerSettings, dest)) for dest in SETTINGS_OPTIONS},
    "webhook_allow": _option(setting_parser(WebhookSettings, "webhook_allow")),
    "shelf": str,
    **{dest: _option(setting_parser(ShelfSettings, dest)) for dest in SHELF_OPTIONS},
}


# rstreamer-worker ------------------------------------------------------------------------

class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (the usage is one ``--help`` away)."""

    def error(self, message: str) -> NoReturn:
        """Exit 2 with ``message`` on one line."""
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def worker_parser() -> argparse.ArgumentParser:
    """The ``rstreamer-worker`` argument parser (defaults are None: resolved by :func:`parse_worker_args`)."""
    parser = OneLineParser(
        prog="rstreamer-worker",
        description="Run supervised worker processes that serve a model on one prefix, or (--shelf) the "
                    "models of a shelf, each on its own prefix, loaded and evicted on demand. "
                    "Every option can also be set by the environment variable shown.",
    )
    p = WORKER_PARSERS
    parser.add_argument("model", nargs="?", type=p["model"], help=_help("package.module:ModelClass (a ManagedModel "
                        "subclass or a batch function)", "model"))
    parser.add_argument("--redis", type=p["redis"], metavar="URL", help=_help("Redis URL or host:port", "redis"))
    parser.add_argument("--prefix", type=p["prefix"], help=_help("the model endpoint's name (required)", "prefix"))
    parser.add_argument("--gpus", type=p["gpus"], metavar="0,1", help=_help("GPU ids; none: CPU workers", "gpus"))
    parser.add_argument("--workers-per-gpu", type=p["workers_per_gpu"], metavar="N",
                        help=_help("worker processes per GPU (per host without --gpus)", "workers_per_gpu"))
    parser.add_argument("--batch-size", type=p["batch_size"], metavar="N", help=_help("largest batch", "batch_size"))
    parser.add_argument("--max-latency", type=p["max_latency"], metavar="SECONDS",
                        help=_help("longest wait for a batch to fill", "max_latency"))
    parser.add_argument("--max-batch-cost", type=p["max_batch_cost"], metavar="N",
                        help=_help("largest cost of a batch, as the model's cost() counts it (e.g. tokens); "
                                   "0: no budget", "max_batch_cost"))
    parser.add_argument("--cost-model", type=p["cost_model"], choices=("padded", "sum"),
                        help=_help("a batch costs len(batch) * max(cost) (padded) or sum(cost)", "cost_model"))
    parser.add_argument("--priorities", type=p["priorities"], metavar="W0,W1,...",
                        help=_help("priority levels and their weights, level 0 (most urgent) first, e.g. 8,1; "
                                   "a busy worker gives level k weight_k/sum of its items (docs/priority.md)",
                                   "priorities"))
    parser.add_argument("--level-max-queue", type=p["level_max_queue"], metavar="N0,N1,...",
                        help=_help("per level, refuse calls while this many items of it and of the more urgent "
                                   "levels wait (0: the client's max_queue)", "level_max_queue"))
    parser.add_argument("--tenant-rate", type=p["tenant_rate"], metavar="ITEMS_PER_S",
                        help=_help("every tenant's quota: items per second over the whole fleet (calls that name "
                                   "a tenant; over it: RateLimited, HTTP 429); 0: no quota", "tenant_rate"))
    parser.add_argument("--tenant-burst", type=p["tenant_burst"], metavar="ITEMS",
                        help=_help("every tenant's bucket: most items at once (0: one second's worth)", "tenant_burst"))
    parser.add_argument("--tenant-quotas", type=p["tenant_quotas"], metavar="NAME=RATE:BURST,...",
                        help=_help("tenants with their own quota, e.g. acme=100:200,free=5:10", "tenant_quotas"))
    parser.add_argument("--tenant-sharing", type=p["tenant_sharing"], choices=("fifo", "fair"),
                        help=_help("how the tenants of one level share the workers: fifo (arrival order) or fair "
                                   "(one item each in turn; docs/priority.md)", "tenant_sharing"))
    parser.add_argument("--webhook-allow", type=p["webhook_allow"], metavar="CIDR|HOST,...",
                        help=_help("internal webhook receivers the workers may call besides public addresses, "
                                   "e.g. 10.0.0.0/8,hooks.internal,*.svc.cluster.local (docs/jobs.md)",
                                   "webhook_allow"))
    parser.add_argument("--shelf", type=p["shelf"], metavar="PATH",
                        help=_help("serve the models of this shelf file (JSON; docs/shelf.md) instead of one model "
                                   "on --prefix: each worker holds --slots of them, loaded on demand", "shelf"))
    parser.add_argument("--slots", type=p["slots"], metavar="N",
                        help=_help("with --shelf: models one worker process holds at once", "slots"))
    parser.add_argument("--memory-budget", type=p["memory_budget"], metavar="SIZE",
                        help=_help("with --shelf: bytes the models of one worker may take, each measured after its "
                                   "load (e.g. 20GiB; 0: no budget)", "memory_budget"))
    parser.add_argument("--shelf-policy", type=p["shelf_policy"], choices=("queue", "lru", "all"),
                        help=_help("with --shelf: queue (placement from the queue's evidence), lru (load on arrival, "
                                   "least recently used out: a baseline) or all (every model resident: a ceiling)",
                                   "shelf_policy"))
    parser.add_argument("--init-args", type=p["init_args"], metavar="JSON",
                        help=_help("JSON array of init_model positional arguments", "init_args"))
    parser.add_argument("--init-kwargs", type=p["init_kwargs"], metavar="JSON",
                        help=_help("JSON object of init_model keyword arguments", "init_kwargs"))
    parser.add_argument("--metrics-port", type=p["metrics_port"], metavar="PORT",
                        help=_help("serve Prometheus metrics: worker i on PORT+i", "metrics_port"))
    parser.add_argument("--metrics-host", type=p["metrics_host"], metavar="ADDRESS",
                        help=_help("address the metrics listen on; 0.0.0.0: every interface (e.g. in a "
                                   "container, for a Prometheus elsewhere)", "metrics_host"))
    parser.add_argument("--log-level", type=p["log_level"], help=_help("logging level", "log_level"))
    parser.add_argument("--log-interval", type=p["log_interval"], metavar="SECONDS",
                        help=_help("seconds between info summary lines, 0: none", "log_interval"))
    parser.add_argument("--max-restarts", type=p["max_restarts"], metavar="N",
                        help=_help("restarts of one worker within 60 s before giving up (crash loop)", "max_restarts"))
    parser.add_argument("--wait-for-redis", type=p["wait_for_redis"], metavar="SECONDS",
                        help=_help("at start, wait this long for Redis to answer before exiting with code 2 "
                                   "(0: exit at once)", "wait_for_redis"))
    parser.add_argument("--check", action="store_true",
                        help="exit 0 if Redis answers PING and the model class imports, else 1 (health check; "
                             "a readiness probe)")
    parser.add_argument("--liveness", action="store_true",
                        help="with --check: exit 0 if a supervisor of the prefix runs on this machine and its loop "
                             "turns, else 1; asks nothing of Redis (a liveness probe: a Redis outage must not "
                             "restart the workers)")
    parser.add_argument("--version", action="version", version=f"%(prog)s {VERSION}")
    return parser


def _help(text: str, dest: str) -> str:
    default = WORKER_DEFAULTS[dest]
    shown = "" if default in (None, [], {}, "") else f", default {default}"
    return f"{text} (env {WORKER_ENV[dest]}{shown})"


def parse_worker_args(argv: list[str], environ: Mapping[str, str]) -> argparse.Namespace:
    """Parse ``argv``; options it lacks come from ``environ``, then from WORKER_DEFAULTS."""
    parser = worker_parser()
    args = parser.parse_args(argv)
    if args.shelf and (args.model or args.prefix):
        parser.error("--shelf names the models and their prefixes: give no model and no --prefix with it")
    for dest, variable in WORKER_ENV.items():
        if getattr(args, dest) is not None:
            continue
        raw = environ.get(variable, "")
        if raw:
            try:
                setattr(args, dest, WORKER_PARSERS[dest](raw))
            except (argparse.ArgumentTypeError, ValueError) as exc:
                parser.error(f"{variable}={raw!r}: {exc}")
        else:
            setattr(args, dest, WORKER_DEFAULTS[dest])
    if args.shelf:
        args.model = args.prefix = None  # each model of the shelf names its own
    elif not args.model:
        parser.error(f"the model (package.module:ModelClass) is required, as an argument or {WORKER_ENV['model']}, "
                     "or --shelf")
    elif not args.prefix:
        parser.error(f"--prefix (or {WORKER_ENV['prefix']}) is required")
    if args.liveness and not args.check:
        parser.error("--liveness goes with --check: rstreamer-worker --check --liveness")
    return args


def build_worker_spec(args: argparse.Namespace, settings: WorkerSettings | None = None) -> Any:
    """A validated WorkerSpec from resolved arguments; raises ConfigError.

    ``settings`` defaults to ``WorkerSettings.from_env()`` (heartbeat, reclaim, drain...);
    batch size and latency come from ``args``.
    """
    from .broker.connection import normalize_broker_url
    from .wire.keys import Keys
    from .worker.supervisor import WorkerSpec

    url = normalize_broker_url(args.redis)
    if args.metrics_port is not None and importlib.util.find_spec("prometheus_client") is None:
        raise ConfigError("--metrics-port needs prometheus-client: pip install prometheus-client")
    options = {dest: getattr(args, dest) for dest in SETTINGS_OPTIONS}
    settings = (settings or WorkerSettings.from_env()).replace(**options)
    settings = settings.replace(webhooks=settings.webhooks.replace(webhook_allow=args.webhook_allow))
    if getattr(args, "shelf", None):  # a namespace built by hand may lack the shelf options
        shelf, shelf_settings = _shelf_of(args, settings)
        # The shelf's name stands for the prefix where one is named (the supervisor's liveness stamp).
        return WorkerSpec(f"shelf {shelf.name!r}", url, shelf.name, settings=settings, log_level=args.log_level,
                          metrics_port=args.metrics_port, log_interval=args.log_interval,
                          metrics_host=args.metrics_host, shelf=shelf, shelf_settings=shelf_settings)
    prefix = Keys(args.prefix).prefix
    _check_model_module(args.model)
    return WorkerSpec(args.model, url, prefix, args.init_args or None, args.init_kwargs or None, settings,
                      log_level=args.log_level, metrics_port=args.metrics_port,
                      log_interval=args.log_interval, metrics_host=args.metrics_host)


def _shelf_of(args: argparse.Namespace, settings: WorkerSettings) -> tuple[Any, ShelfSettings]:
    """The shelf file, validated (every model's class checked without importing it), and the
    placement settings; raises ConfigError naming the model and field."""
    from .shelf.spec import ShelfError, load_shelf

    shelf = load_shelf(args.shelf, settings)
    for name, model in shelf.models.items():
        try:
            _check_model_module(model.model)
        except ConfigError as exc:
            raise ShelfError(f"{args.shelf}: model {name!r}: field 'model': {exc}") from None
    shelf_settings = ShelfSettings.from_env(**{dest: getattr(args, dest) for dest in SHELF_OPTIONS})
    if shelf_settings.shelf_policy == "all" and shelf_settings.slots < len(shelf.models):
        raise ConfigError(f"--shelf-policy all keeps every model resident: it needs --slots >= "
                          f"{len(shelf.models)} (the shelf's models), got {shelf_settings.slots}")
    return shelf, shelf_settings


def _check_model_module(model: str) -> None:
    """Fail fast on a misspelt module or class without importing it (the supervisor stays light)."""
    from .worker.preflight import check_model_name

    check_model_name(model)


def check_worker(args: argparse.Namespace) -> tuple[bool, str]:
    """The ``--check`` health check: (healthy, one-line message). Never shows a password."""
    from .broker.connection import ping_broker, redacted
    from .model.managed import resolve_model
    from .wire.keys import Keys

    shown = redacted(args.redis)
    if getattr(args, "shelf", None):  # a namespace built by hand may lack the shelf options
        return _check_shelf_worker(args, shown)
    try:
        Keys(args.prefix)
    except ConfigError as exc:
        return False, str(exc)
    try:
        ping_broker(args.redis)
    except Exception as exc:  # any failure is an unhealthy answer, not a traceback
        return False, _scrub(str(exc), args.redis)
    try:
        resolve_model(args.model)
    except Exception as exc:
        return False, f"model {args.model!r} does not import: {exc}"
    return True, f"ok: Redis at {shown} answers PING; model {args.model} imports"


def _check_shelf_worker(args: argparse.Namespace, shown: str) -> tuple[bool, str]:
    from .broker.connection import ping_broker

    try:
        shelf, _ = _shelf_of(args, WorkerSettings.from_env())
    except ConfigError as exc:
        return False, str(exc)
    try:
        ping_broker(args.redis)
    except Exception as exc:  # any failure is an unhealthy answer, not a traceback
        return False, _scrub(str(exc), args.redis)
    return True, f"ok: Redis at {shown} answers PING; shelf {shelf.name!r} lists {len(shelf.models)} models"


def check_liveness(args: argparse.Namespace) -> tuple[bool, str]:
    """The ``--check --liveness`` probe: (alive, one-line message). Local only: no Redis, no model import."""
    from .wire.keys import Keys
    from .worker.alive import check_alive

    try:
        shelf = getattr(args, "shelf", None)
        prefix = _shelf_of(args, WorkerSettings.from_env())[0].name if shelf else Keys(args.prefix).prefix
    except ConfigError as exc:
        return False, str(exc)
    return check_alive(prefix)


def _scrub(message: str, url: str) -> str:
    try:
        password = urllib.parse.urlsplit(url).password
    except ValueError:
        password = None
    return message.replace(password, "***") if password else message


def worker_main(argv: list[str] | None = None) -> int:
    """``rstreamer-worker``: supervise worker processes until SIGTERM; the exit code is the supervisor's."""
    import_from_working_directory()
    args = parse_worker_args(list(sys.argv[1:] if argv is None else argv), os.environ)
    configure_logging(args.log_level, "supervisor")
    if args.check:
        healthy, message = check_liveness(args) if args.liveness else check_worker(args)
        print(f"rstreamer-worker --check: {message}", file=sys.stdout if healthy else sys.stderr)
        return 0 if healthy else 1
    from .worker.placement import per_gpu
    from .worker.supervisor import Supervisor

    try:
        spec = build_worker_spec(args)
        slots = per_gpu(args.gpus, args.workers_per_gpu)
        # What --check finds stops the command here, in one line, before any worker starts.
        _wait_for_redis(spec, args.wait_for_redis)
    except (ConfigError, BrokerUnavailable) as exc:
        print(f"rstreamer-worker: {exc}", file=sys.stderr)
        return 2
    if args.gpus and os.environ.get("CUDA_VISIBLE_DEVICES"):
        logging.getLogger(__name__).warning(
            "CUDA_VISIBLE_DEVICES=%s is set; each worker replaces it with its own id from --gpus (%s)",
            os.environ["CUDA_VISIBLE_DEVICES"], ",".join(map(str, args.gpus)))
    return Supervisor(spec, slots, max_restarts=args.max_restarts).run()


def _wait_for_redis(spec: Any, wait: float) -> None:
    """``wait_for_broker``, stamped alive meanwhile: a supervisor that waits for its Redis is alive,
    and its liveness probe must say so (the supervisor stamps the same file once it runs)."""
    from .worker.alive import AliveStamp
    from .worker.preflight import wait_for_broker

    stamp = AliveStamp(spec.prefix)
    try:
        wait_for_broker(spec.redis_url, wait, tick=stamp.touch)
    except BaseException:
        stamp.remove()
        raise


# rstreamer status ------------------------------------------------------------------------

def status_parser() -> argparse.ArgumentParser:
    """The ``rstreamer status`` argument parser."""
    parser = argparse.ArgumentParser(prog="rstreamer status", description="Show a prefix's queue and workers, "
                                     "or every prefix when none is given.")
    parser.add_argument("--redis", metavar="URL", default=os.environ.get(WORKER_ENV["redis"]) or DEFAULT_REDIS_URL,
                        help=f"Redis URL or host:port (env {WORKER_ENV['redis']}, default {DEFAULT_REDIS_URL})")
    parser.add_argument("--prefix", default=os.environ.get(WORKER_ENV["prefix"]) or None,
                        help=f"the prefix to show (env {WORKER_ENV['prefix']}); none: list every prefix")
    parser.add_argument("--all", action="store_true", help="list every prefix even if RSTREAMER_PREFIX is set")
    parser.add_argument("--shelf", metavar="NAME", help="show one shelf: its workers, what each holds, and per "
                        "model holders, backlog, loads, evictions and load time (the list of every prefix shows "
                        "every shelf too)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--interval", type=_seconds, default=1.0, metavar="SECONDS",
                        help="window over which throughput is measured; 0: skip it (default 1)")
    return parser


def status_main(argv: list[str]) -> int:
    """``rstreamer status``."""
    from .broker.connection import create_redis, normalize_broker_url, redacted
    from .ops import shelves, status
    from .wire.shelf import list_shelves

    args = status_parser().parse_args(argv)
    dead_after = WorkerSettings.from_env().dead_after
    try:
        url = normalize_broker_url(args.redis)
        client = create_redis(url, socket_timeout=5.0, retries=1)
    except ValueError as exc:  # ConfigError, or one of redis-py's own
        print(f"rstreamer status: {exc}", file=sys.stderr)
        return 2
    except BrokerUnavailable as exc:  # a Cluster client reads its slot map at once
        print(f"rstreamer status: {exc}", file=sys.stderr)
        return 1
    report: Any
    try:
        if args.shelf:
            report = shelves.shelf_status(client, args.shelf, dead_after, events=shelves.EVENTS_SHOWN)
            if not report["workers"] and not report["models"]:
                known = ", ".join(list_shelves(client)) or "none"
                print(f"rstreamer status: shelf {args.shelf!r} is unknown at {redacted(url)} (known shelves: "
                      f"{known})", file=sys.stderr)
                return 1
            text = shelves.format_shelf_status(report)
        elif args.prefix and not args.all:
            if not status.prefix_known(client, args.prefix):
                print(f"rstreamer status: {status.unknown_prefix_message(client, args.prefix, redacted(url))}",
                      file=sys.stderr)
                return 1
            report = status.prefix_status(client, args.prefix, dead_after, args.interval)
            text = status.format_prefix_status(report)
        else:
            summaries = status.all_prefixes_status(client, dead_after)
            found = shelves.shelves_status(client, dead_after)
            report = {"prefixes": summaries, "shelves": found}
            parts = [status.format_all_prefixes(summaries)] + ([shelves.format_shelves(found)] if found else [])
            text = "\n\n".join(parts)
    except ConfigError as exc:
        print(f"rstreamer status: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # redis errors: one clear line, no traceback
        print(f"rstreamer status: Redis at {redacted(url)}: {_scrub(str(exc), url)}", file=sys.stderr)
        return 1
    finally:
        client.close()
    print(json.dumps(report, indent=2) if args.json else text)
    return 0


# rstreamer -------------------------------------------------------------------------------

TOOLS_GROUP = "rstreamer.commands"


def tool_main(name: str, argv: list[str]) -> int:
    """``rstreamer bench|demo|chaos``: a developer tool, found by name in the ``rstreamer.commands``
    entry-point group (the package ``rstreamer_tools`` outside the library), imported only when asked for."""
    found = importlib.metadata.entry_points(group=TOOLS_GROUP, name=name)
    try:
        tool = next(iter(found)).load()
    except StopIteration:
        missing = f"no {TOOLS_GROUP} entry point {name!r} is installed (install rstreamer from its repository)"
    except ImportError as exc:
        missing = str(exc)
    else:
        return int(tool(argv) or 0)
    print(f"rstreamer {name}: not available: {missing}", file=sys.stderr)
    return 2


def bench_main(argv: list[str]) -> int:
    """``rstreamer bench``."""
    return tool_main("bench", argv)


def main(argv: list[str] | None = None) -> int:
    """``rstreamer COMMAND ...``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="", file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        print(f"rstreamer {VERSION}")
        return 0
    command, rest = argv[0], argv[1:]
    if command == "worker":
        return worker_main(rest)
    commands: dict[str, Callable[[list[str]], int]] = {
        "demo": partial(tool_main, "demo"), "status": status_main, "bench": bench_main,
        "chaos": partial(tool_main, "chaos"),
        "dashboard": _dashboard_main, "exporter": _exporter_main, "jobs": _jobs_main, "dead": _dead_main,
        "forget": _forget_main,
    }
    if command not in commands:
        print(f"rstreamer: unknown command {command!r}\n{USAGE}", end="", file=sys.stderr)
        return 2
    configure_logging("WARNING", f"rstreamer {command}")
    try:
        return commands[command](rest)
    except (ConfigError, BrokerUnavailable) as exc:  # a setting or an unreachable Redis: one line
        print(f"rstreamer {command}: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ConfigError) else 1


def _jobs_main(argv: list[str]) -> int:
    from .ops.admin import jobs_main

    return jobs_main(argv)


def _dead_main(argv: list[str]) -> int:
    from .ops.admin import dead_main

    return dead_main(argv)


def _exporter_main(argv: list[str]) -> int:
    from .ops.exporter import main as exporter_main

    return exporter_main(argv)


def _forget_main(argv: list[str]) -> int:
    from .ops.admin import forget_main

    return forget_main(argv)


def _dashboard_main(argv: list[str]) -> int:
    from .ops.dashboard import main as dashboard_main

    return dashboard_main(argv)
