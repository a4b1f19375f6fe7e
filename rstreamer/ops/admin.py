"""``rstreamer jobs list|show|cancel|purge``, ``rstreamer dead list|show|replay|purge`` and
``rstreamer forget PREFIX``.

Thin: arguments → one call of :mod:`rstreamer.jobs.sync`, :mod:`rstreamer.ops.deadletters` or
:mod:`rstreamer.ops.status` → a table or JSON on stdout. Exit codes: 0 done (nothing to do
included), 1 Redis failed, the prefix is unknown or an id was not found, 2 bad arguments.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Callable
from typing import Any

import redis

from ..broker.connection import create_redis, normalize_broker_url, redacted
from ..errors import BrokerUnavailable, ConfigError, InvalidJobId, JobError, JobNotFound, PrefixInUse
from ..jobs.core import JobInfo
from ..jobs.sync import JobClient
from ..settings import DEFAULT_REDIS_URL, WorkerSettings
from ..wire.keys import DEFAULT_PREFIX, Keys, is_job_id
from .deadletters import (
    DeadLetter,
    as_json,
    purge,
    read_dead_letter,
    read_dead_letters,
    replay,
)
from .status import forget_prefix, prefix_keys, prefix_known, unknown_prefix_message

_LETTER_ID = re.compile(r"[0-9]{1,20}-[0-9]{1,20}")
MIN_ID_PREFIX = 4
"""Shortest start of a job id that ``rstreamer jobs show|cancel|purge`` accepts (git's minimum)."""


class Failed(Exception):
    """A command that ran and failed: its message is printed, the exit code is 1."""


def _common(parser: argparse.ArgumentParser, prefix: bool = True) -> None:
    parser.add_argument("--redis", metavar="URL", default=os.environ.get("RSTREAMER_REDIS_URL") or DEFAULT_REDIS_URL,
                        help=f"Redis URL or host:port (env RSTREAMER_REDIS_URL, default {DEFAULT_REDIS_URL})")
    if prefix:
        # None: not chosen. The default is then used, and an unknown default says how to name one.
        parser.add_argument("--prefix", default=os.environ.get("RSTREAMER_PREFIX") or None,
                            help=f"the model endpoint (env RSTREAMER_PREFIX, default {DEFAULT_PREFIX!r}); an "
                                 "unknown prefix is an error that lists the known ones")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")


def jobs_parser() -> argparse.ArgumentParser:
    """The ``rstreamer jobs`` argument parser."""
    parser = argparse.ArgumentParser(prog="rstreamer jobs", description="List, show, cancel and purge durable jobs.")
    verbs = parser.add_subparsers(dest="verb", required=True)
    listing = verbs.add_parser("list", help="the prefix's jobs, newest first")
    listing.add_argument("--limit", type=int, default=50, help="most jobs to list (default 50)")
    show = verbs.add_parser("show", help="one job: state, counters, meta and its first outputs")
    show.add_argument("job_id", help=f"the job's id, or a unique start of it ({MIN_ID_PREFIX} digits or more)")
    show.add_argument("--outputs", type=int, default=10, metavar="N", help="outputs to preview (default 10)")
    cancel = verbs.add_parser("cancel", help="stop jobs: no item not yet started runs")
    cancel.add_argument("job_ids", nargs="+", metavar="job_id", help="ids, or unique starts of ids")
    purge_jobs = verbs.add_parser("purge", help="delete jobs and their results now")
    purge_jobs.add_argument("job_ids", nargs="*", metavar="job_id", help="ids, or unique starts of ids")
    purge_jobs.add_argument("--finished", action="store_true", help="every job that is done, failed or cancelled")
    for sub in (listing, show, cancel, purge_jobs):
        _common(sub)
    return parser


def dead_parser() -> argparse.ArgumentParser:
    """The ``rstreamer dead`` argument parser."""
    parser = argparse.ArgumentParser(prog="rstreamer dead",
                                     description="List, show, replay and purge a prefix's dead letters.")
    verbs = parser.add_subparsers(dest="verb", required=True)
    listing = verbs.add_parser("list", help="the newest dead letters: reason, deliveries, payload preview")
    listing.add_argument("--count", type=int, default=50, help="most letters to list (default 50)")
    show = verbs.add_parser("show", help="one dead letter and every field of its entry")
    show.add_argument("letter_id")
    replays = verbs.add_parser("replay", help="put dead letters back on the prefix's request stream")
    replays.add_argument("letter_ids", nargs="*", metavar="letter_id")
    replays.add_argument("--all", action="store_true", help="every dead letter of the prefix")
    replays.add_argument("--timeout", type=float, default=60.0, metavar="SECONDS",
                         help="seconds a replayed item has to run (default 60)")
    purges = verbs.add_parser("purge", help="delete dead letters")
    purges.add_argument("letter_ids", nargs="*", metavar="letter_id")
    purges.add_argument("--all", action="store_true", help="every dead letter of the prefix")
    for sub in (listing, show, replays, purges):
        _common(sub)
    return parser


def forget_parser() -> argparse.ArgumentParser:
    """The ``rstreamer forget`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="rstreamer forget", description="Delete every key of a prefix that no live worker serves: its "
        "request streams, dead letters, jobs and replies. `rstreamer status` marks such prefixes idle.")
    parser.add_argument("prefix", help="the prefix to forget")
    parser.add_argument("--yes", action="store_true", help="delete (without it: say what would be deleted, exit 1)")
    _common(parser, prefix=False)
    return parser


def jobs_main(argv: list[str]) -> int:
    """``rstreamer jobs``."""
    return _run("rstreamer jobs", jobs_parser().parse_args(argv), _jobs_verb)


def dead_main(argv: list[str]) -> int:
    """``rstreamer dead``."""
    return _run("rstreamer dead", dead_parser().parse_args(argv), _dead_verb)


def forget_main(argv: list[str]) -> int:
    """``rstreamer forget PREFIX``."""
    parser = forget_parser()
    args = parser.parse_args(argv)
    if not args.prefix:
        parser.error("name the prefix to forget")
    return _run("rstreamer forget", args, _forget, check_prefix=False)


def _run(prog: str, args: argparse.Namespace, verb: Callable[[Any, Keys, argparse.Namespace], Any],
         check_prefix: bool = True) -> int:
    try:
        url = normalize_broker_url(args.redis)
        keys = Keys(args.prefix or DEFAULT_PREFIX)
        client = create_redis(url, socket_timeout=5.0, retries=1)
    except (ValueError, ConfigError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    except BrokerUnavailable as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    try:
        if check_prefix:
            _check_prefix(client, keys, url, chosen=bool(args.prefix))
        document, text = verb(client, keys, args)
    except (JobError, Failed, PrefixInUse) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ValueError) else 1
    except (redis.RedisError, BrokerUnavailable) as exc:  # one clear line, no traceback
        print(f"{prog}: Redis at {redacted(url)}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()
    print(json.dumps(document, indent=2, default=str) if args.json else text)
    return 0


def _check_prefix(client: Any, keys: Keys, url: str, chosen: bool) -> None:
    """Refuse a prefix nothing exists under, as ``rstreamer status`` does: a misspelt one would
    otherwise read as "no jobs" or "no dead letters"."""
    if prefix_known(client, keys.prefix):
        return
    hint = "" if chosen else f"; no --prefix (or RSTREAMER_PREFIX) was given, so {DEFAULT_PREFIX!r} was read"
    raise Failed(unknown_prefix_message(client, keys.prefix, redacted(url)) + hint)


# jobs -----------------------------------------------------------------------------------

def _jobs_verb(client: Any, keys: Keys, args: argparse.Namespace) -> tuple[Any, str]:
    jobs = JobClient(client, keys, "", 1)
    if args.verb == "list":
        infos = jobs.list(args.limit)
        return [info.as_json() for info in infos], _job_table(infos)
    if args.verb == "show":
        job = jobs.get(_job_id(jobs, args.job_id))
        info = job.info()
        items = job.results_page(0, max(0, args.outputs))
        outputs = [{"index": i.index, "output": repr(i.output) if not i.ok else i.value} for i in items]
        lines = [_job_line(info), f"meta: {json.dumps(info.meta)}"]
        lines += [f"  [{i.index}] {_short(repr(i.output))}" for i in items]
        return {**info.as_json(), "outputs": outputs}, "\n".join(lines)
    if args.verb == "cancel":
        done = {job_id: jobs.get(job_id).cancel() for job_id in (_job_id(jobs, text) for text in args.job_ids)}
        lines = [f"{job_id} {'cancelled' if ok else 'had already finished'}" for job_id, ok in done.items()]
        return done, "\n".join(lines)
    ids = [_job_id(jobs, text) for text in args.job_ids]
    if args.finished:
        ids += [info.id for info in jobs.list(1_000_000) if info.state.finished]
    if not ids:
        raise Failed("name job ids to purge, or --finished")
    purged = [job_id for job_id in dict.fromkeys(ids) if jobs.purge(job_id)]
    return {"purged": purged}, f"purged {len(purged)} job(s)"


def _job_id(jobs: JobClient, text: str) -> str:
    """A whole job id from ``text``: the id itself, or a unique start of one (as git takes a commit's)."""
    text = text.strip().lower()
    if is_job_id(text):
        return text
    if len(text) < MIN_ID_PREFIX or len(text) > 32 or any(c not in "0123456789abcdef" for c in text):
        raise InvalidJobId(f"invalid job id {text!r}: 32 hex digits, or a unique start of one "
                           f"({MIN_ID_PREFIX} digits or more)")
    found = jobs.ids_starting_with(text)
    if not found:
        raise JobNotFound(f"no job id starts with {text!r} on prefix {jobs.keys.prefix!r}")
    if len(found) > 1:
        shown = ", ".join(found[:10]) + (f" and {len(found) - 10} more" if len(found) > 10 else "")
        raise InvalidJobId(f"job id {text!r} is ambiguous on prefix {jobs.keys.prefix!r}: it starts {len(found)} "
                           f"jobs ({shown}); give more digits")
    return found[0]


def _job_table(infos: list[JobInfo]) -> str:
    if not infos:
        return "no jobs"
    return "\n".join([f"{'job id':32}  {'status':9}  {'done':>8}  {'failed':>6}  {'total':>8}  created"]
                     + [_job_line(info) for info in infos])


def _job_line(info: JobInfo) -> str:
    created = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(info.created))
    return (f"{info.id}  {info.state.value:9}  {info.progress.done:>8}  {info.progress.failed:>6}  "
            f"{info.progress.total:>8}  {created}Z")


def _short(text: str, width: int = 100) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


# dead letters ---------------------------------------------------------------------------

def _dead_verb(client: Any, keys: Keys, args: argparse.Namespace) -> tuple[Any, str]:
    if args.verb == "list":
        letters = read_dead_letters(client, keys, args.count)
        return [as_json(letter) for letter in letters], _letter_table(letters)
    if args.verb == "show":
        found = read_dead_letter(client, keys, _letter_id(args.letter_id))
        if found is None:
            raise Failed(f"no dead letter {args.letter_id} on prefix {keys.prefix!r}")
        letter, entry = found
        lines = [f"{key}: {value}" for key, value in as_json(letter).items()]
        lines += ["entry fields:"] + [f"  {key}: {value}" for key, value in entry.items()]
        return {**as_json(letter), "fields": entry}, "\n".join(lines)
    ids = _selected(client, keys, args)
    if not ids:  # --all with no dead letter: nothing to do is not a failure
        return {"replayed" if args.verb == "replay" else "purged": 0}, \
            f"nothing to {args.verb}: prefix {keys.prefix!r} has no dead letters"
    if args.verb == "replay":
        count = replay(client, keys, ids, args.timeout)
        return {"replayed": count}, f"replayed {count} dead letter(s) to {keys.requests}"
    count = purge(client, keys, ids)
    return {"purged": count}, f"purged {count} dead letter(s)"


def _letter_id(text: str) -> str:
    if not _LETTER_ID.fullmatch(text):
        raise Failed(f"invalid dead letter id {text!r}: a stream id such as 1700000000000-0")
    return text


def _selected(client: Any, keys: Keys, args: argparse.Namespace) -> list[str]:
    ids = [_letter_id(text) for text in args.letter_ids]
    if not ids and not args.all:
        raise Failed("name dead letter ids, or --all")
    if args.all:
        ids += [raw.decode() for raw, _ in client.xrange(keys.dead)]
    return list(dict.fromkeys(ids))


def _letter_table(letters: list[DeadLetter]) -> str:
    if not letters:
        return "no dead letters"
    lines = []
    for letter in letters:
        at = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(letter.at_ms / 1000))
        lines.append(f"{letter.id}  {at}Z  deliveries={letter.deliveries or '?'}  entry={letter.entry}\n"
                     f"    reason: {_short(letter.reason)}\n    payload: {_short(letter.preview)}")
    return "\n".join(lines)


# forget ---------------------------------------------------------------------------------

def _forget(client: Any, keys: Keys, args: argparse.Namespace) -> tuple[Any, str]:
    url = redacted(normalize_broker_url(args.redis))
    names = prefix_keys(client, keys.prefix)
    if not names:
        raise Failed(unknown_prefix_message(client, keys.prefix, url))
    if not args.yes:
        raise Failed(f"prefix {keys.prefix!r} has {len(names)} key(s) at {url} ({_kinds(keys, names)}); "
                     f"run again with --yes to delete them for ever")
    deleted = forget_prefix(client, keys.prefix, WorkerSettings.from_env().dead_after)
    return {"prefix": keys.prefix, "deleted": deleted}, f"forgot prefix {keys.prefix!r}: deleted {deleted} key(s)"


def _kinds(keys: Keys, names: list[str]) -> str:
    """What the keys of a prefix hold, counted by kind: "2 request streams, 1 dead-letter stream, ..."."""
    counts: dict[str, int] = {}
    start = len(keys.pattern) - 1
    for name in names:
        kind = name[start:].split(":", 1)[0]
        counts[kind] = counts.get(kind, 0) + 1
    return ", ".join(f"{kind} {count}" for kind, count in sorted(counts.items()))
