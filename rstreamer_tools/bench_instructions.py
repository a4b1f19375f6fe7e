"""`rstreamer bench instructions`: the instructions Redis runs per item on the hot path, phase by
phase, counted by callgrind (issue 26).

Time on a shared 2-vCPU VM moves 10 to 25 % from one run to the next, more than most changes to
a script are worth; callgrind counts instructions, which do not move (about 1 % here). One
redis-server runs under ``valgrind --tool=callgrind``; a client writes what the hot path writes,
a phase at a time, and the count is dumped after each: ``--cycles`` times ENQUEUE_CALLS of
``--group`` one-item calls ``--groups`` times (one token each), then as many XREADGROUPs of one
batch (``--group`` x ``--groups`` entries), then as many FINISHes acking each batch and pushing one
reply message to each token, then the BLPOPs of the replies. Per item answered: the instructions
of each phase (the commands, their scripts and Redis's reading and writing of them).

``--lone`` measures a lone caller's path instead: ``--cycles`` calls of one item, each on a stream
of its own that holds nothing else, as a lone caller finds its prefix's (its ENQUEUE finds the
stream empty, its FINISH deletes one entry), phase by phase as above.

``--tree PATH`` (repeatable) measures another checkout of the repository instead, its scripts and
the arguments its own code builds (PATH goes in front of PYTHONPATH): an A/B of a change to a
script, side by side in one run.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import redis

if TYPE_CHECKING:
    from rstreamer.wire.keys import Keys

PHASES = ("ENQUEUE", "XREADGROUP", "FINISH", "BLPOP")
_SUMMARY = re.compile(rb"^(?:summary|totals): (\d+)", re.M)


@contextlib.contextmanager
def callgrind_server(deadline_s: float = 60.0) -> Iterator[tuple[redis.Redis, Callable[[], int]]]:
    """A redis-server under callgrind, and a function that dumps its count: the instructions it
    ran since the previous dump (or since it started)."""
    from rstreamer.broker.embedded import EmbeddedRedis

    with tempfile.TemporaryDirectory(prefix="rstreamer-callgrind-") as folder:
        out = Path(folder) / "callgrind.out"
        # --hz 1: Redis's timer work (10 times a second by default, slower under valgrind) adds to
        # a phase in proportion to its wall time, which the machine's load sets.
        server = EmbeddedRedis(extra_args=("--hz", "1", "--dynamic-hz", "no"),
                               launcher=("valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"))
        dumps = 0

        def dump() -> int:
            nonlocal dumps
            dumps += 1
            subprocess.run(["callgrind_control", "-d", str(server.pid)], capture_output=True, check=True)
            return _read_count(Path(f"{out}.{dumps}"), time.monotonic() + deadline_s)

        server.start(timeout=deadline_s)
        client = redis.Redis(port=server.port)
        try:
            yield client, dump
        finally:
            client.close()
            server.close()


def _until(ready: Callable[[], bool], deadline: float, what: str) -> None:
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up waiting for {what}")
        time.sleep(0.05)


def _read_count(path: Path, deadline: float) -> int:
    """The instructions of one callgrind dump, once its file is written whole."""
    found: list[int] = []

    def written() -> bool:
        if path.exists():
            found[:] = [int(m) for m in _SUMMARY.findall(path.read_bytes())]
        return bool(found)

    _until(written, deadline, f"callgrind's dump {path.name}")
    return found[0]


def measure(cycles: int, group: int, groups: int) -> dict[str, float]:
    """Instructions per item answered of each phase (see the module's docstring)."""
    from rstreamer.batching.batcher import Outcome
    from rstreamer.wire.groups import ensure_groups
    from rstreamer.wire.keys import Keys
    from rstreamer.wire.messages import QueueLimits, enqueue_args, enqueue_keys, pack_results
    from rstreamer.wire.scripts import scripts

    keys = Keys("instructions")
    tokens = [f"bench{n}:0" for n in range(groups)]
    calls = [([b"\x92\xa5hello\x01"], time.time() + 3600, 0, None) for _ in range(group)]
    with callgrind_server() as (client, dump):
        ensure_groups(client, keys, 1)
        script = scripts(client)
        enqueue = {t: enqueue_args(QueueLimits(0, 0, keys.group), t, calls, time.time(), levels=b"") for t in tokens}
        stream_keys = enqueue_keys(keys, [0])
        # Each script once before counting (EVALSHA's first call loads it), its entries acked and
        # gone: an entry left pending would send every FINISH to XDEL instead of the trim.
        script.enqueue_calls(keys=stream_keys, args=enqueue[tokens[0]])
        warm = _read_ids(client, keys.requests, keys.group)
        _finish(script, keys, [], [], warm)
        message = pack_results([(i, Outcome(True, value=i)) for i in range(group)])
        dump()
        counts: dict[str, int] = {}
        for _ in range(cycles):
            for token in tokens:
                script.enqueue_calls(keys=stream_keys, args=enqueue[token])
        counts["ENQUEUE"] = dump()
        batches = [_read_ids(client, keys.requests, keys.group, group * groups) for _ in range(cycles)]
        counts["XREADGROUP"] = dump()
        for ids in batches:
            _finish(script, keys, tokens, message, ids)
        counts["FINISH"] = dump()
        for _ in range(cycles):
            for token in tokens:
                client.blpop([keys.reply(token)], 1)
        counts["BLPOP"] = dump()
    items = cycles * group * groups
    return {phase: counts[phase] / items for phase in PHASES}


def measure_lone(calls: int) -> dict[str, float]:
    """Instructions per call of each phase of ``calls`` lone calls, each alone on its own stream."""
    from rstreamer.batching.batcher import Outcome
    from rstreamer.wire.groups import ensure_groups
    from rstreamer.wire.keys import Keys
    from rstreamer.wire.messages import QueueLimits, enqueue_args, enqueue_keys, pack_results
    from rstreamer.wire.scripts import scripts

    prefixes = [Keys(f"lone{n}") for n in range(calls + 1)]  # the first one warms the scripts up
    call = [([b"\x92\xa5hello\x01"], time.time() + 3600, 0, None)]
    message = pack_results([(0, Outcome(True, value=0))])
    with callgrind_server() as (client, dump):
        script = scripts(client)
        for keys in prefixes:
            ensure_groups(client, keys, 1)
        args = {keys.prefix: enqueue_args(QueueLimits(0, 0, keys.group), "lone:0", call, time.time(), levels=b"")
                for keys in prefixes}

        def enqueue(keys: Keys) -> None:
            script.enqueue_calls(keys=enqueue_keys(keys, [0]), args=args[keys.prefix])

        warm, measured = prefixes[0], prefixes[1:]
        enqueue(warm)
        _finish(script, warm, ["lone:0"], message, _read_ids(client, warm.requests, warm.group))
        dump()
        counts: dict[str, int] = {}
        for keys in measured:
            enqueue(keys)
        counts["ENQUEUE"] = dump()
        read = [_read_ids(client, keys.requests, keys.group) for keys in measured]
        counts["XREADGROUP"] = dump()
        for keys, ids in zip(measured, read, strict=True):
            _finish(script, keys, ["lone:0"], message, ids)
        counts["FINISH"] = dump()
        for keys in measured:
            client.blpop([keys.reply("lone:0")], 1)
        counts["BLPOP"] = dump()
    return {phase: counts[phase] / calls for phase in PHASES}


def _finish(script: Any, keys: Keys, tokens: Sequence[str], message: Sequence[bytes], ids: Sequence[bytes]) -> None:
    """FINISH as a worker sends it: ack and delete ``ids`` on the request stream and push
    ``message`` (the rows of one reply) to each token's reply key."""
    replies: list[Any] = []
    for _ in tokens:
        replies += [60_000, len(message), *message]
    script.finish(keys=[keys.dead, keys.requests, *(keys.reply(t) for t in tokens)],
                  args=[keys.group, 1, 0, 100, 1 << 20, len(ids), *replies, *ids])


def measured(args: argparse.Namespace) -> dict[str, float]:
    """:func:`measure_lone` or :func:`measure`, as the options ask."""
    return measure_lone(args.cycles) if args.lone else measure(args.cycles, args.group, args.groups)


def _read_ids(client: redis.Redis, stream: str, group: str, count: int | None = None) -> list[bytes]:
    """The ids of the entries one XREADGROUP of new entries takes."""
    reply: Any = client.xreadgroup(group, "bench", {stream: ">"}, count=count)
    return [entry_id for entry_id, _ in reply[0][1]]


def measure_tree(tree: str, args: argparse.Namespace) -> dict[str, float]:
    """:func:`measured` of this file in a process that imports rstreamer from the checkout
    ``tree``: an older tree's own copy of this tool may lack what is asked."""
    code = ("import argparse, json, runpy, sys; tool = runpy.run_path(sys.argv[1]); "
            "print(json.dumps(tool['measured'](argparse.Namespace(**json.loads(sys.argv[2])))))")
    env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve())}
    # In the tree's folder: `python -c` puts the working folder first on sys.path.
    done = subprocess.run([sys.executable, "-c", code, str(Path(__file__).resolve()), json.dumps(vars(args))],
                          env=env, cwd=tree, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"measuring {tree} failed: {done.stderr.strip()[-2000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def format_report(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    shape = (f"{args.cycles} lone calls of one item, each on a stream of its own" if args.lone else
             f"{args.groups} ENQUEUEs of {args.group} one-item calls per batch, {args.cycles} batches")
    lines = [f"Redis instructions per item (callgrind), {shape}",
             f"{'tree':<24} " + " ".join(f"{phase:>11}" for phase in PHASES) + f" {'all':>11}"]
    first = sum(rows[0][p] for p in PHASES)
    for row in rows:
        total = sum(row[p] for p in PHASES)
        change = f"  {100 * (total / first - 1):+.1f} % against the first" if row is not rows[0] else ""
        lines.append(f"{row['tree'][-24:]:<24} " + " ".join(f"{row[p]:11,.0f}" for p in PHASES)
                     + f" {total:11,.0f}{change}")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="rstreamer bench instructions", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cycles", type=int, default=100, help="batches per phase (default: 100)")
    parser.add_argument("--group", type=int, default=16, help="one-item calls per ENQUEUE (default: 16)")
    parser.add_argument("--groups", type=int, default=2, help="ENQUEUEs per batch (default: 2)")
    parser.add_argument("--lone", action="store_true",
                        help="lone calls, each alone on an empty stream (--cycles of them), instead of batches")
    parser.add_argument("--tree", action="append", default=[],
                        help="a checkout to measure instead of the installed rstreamer (repeatable)")
    parser.add_argument("--output", default="bench-output", help="folder for bench-instructions.json")
    args = parser.parse_args(argv)
    if min(args.cycles, args.group, args.groups) < 1:
        parser.error("--cycles, --group and --groups must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the bench; print the report; write ``bench-instructions.json``."""
    args = parse_args(argv)
    rows = ([{"tree": tree, **measure_tree(tree, args)} for tree in args.tree] if args.tree
            else [{"tree": "installed", **measured(args)}])
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    document = {"options": vars(args), "machine": {"time": time.strftime("%Y-%m-%dT%H:%M:%S")}, "rows": rows}
    (output / "bench-instructions.json").write_text(json.dumps(document, indent=2))
    print(format_report(rows, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
