"""`rstreamer demo`: the whole stack on one machine, driven by real HTTP traffic.

Redis (embedded unless RSTREAMER_REDIS_URL is set), two all-MiniLM-L6-v2 embedding workers
started with ``rstreamer-worker``, the Flask app under gunicorn. One call embeds 60 real
sentences and checks them for meaning (a paraphrase is closer than an unrelated sentence);
then phases of more and more concurrent HTTP clients (1, 8, 32, 128 by default, 4 s each),
each sending one sentence at a time, and a last one of 256 callers through the Python client
(as a fleet of web processes would call) show how the workers' batches grow with the load. A
summary per phase is printed, with why the batches are the size they are, and a plot of
latency, throughput and batch sizes is written. Everything it started is stopped before it
returns. ``--serve`` keeps the stack up for manual requests until Ctrl-C instead.

``--generate`` shows a generative model instead: a real chat model, SmolLM2-135M-Instruct,
answers a few questions at once, streamed as they are made, continuously batched (see
``rstreamer_tools/demo_generate.py``).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import shutil
import signal
import sys
import threading
import time
import uuid
from pathlib import Path

from rstreamer.broker.embedded import free_port
from rstreamer_tools import demo_chat, demo_generate
from rstreamer_tools import demo_load as load
from rstreamer_tools.arguments import positive_counts
from rstreamer_tools.stack import (
    FORCED,
    INTERRUPTS,
    Stack,
    console_script,
    open_stack,
    run_cancellable,
    source_root,
    wait_for_workers,
    wait_ready,
    web_command,
)

MODEL = "workers.embedding:EmbeddingModel"
# Concurrent clients of each load phase: one client (no batching), then past the 2 x 32 items
# that two workers take per read, so that the batches fill.
LOAD_PHASES = [1, 8, 32, 128]
# Callers of the last phase, through the Python client: enough that the batches fill.
CALLERS = 256


# stop signals ----------------------------------------------------------------------------------


# processes ---------------------------------------------------------------------------------


def worker_command(args: argparse.Namespace) -> list[str]:
    return [*console_script("rstreamer-worker", "rstreamer.cli", "worker_main"),
            "--workers-per-gpu", str(args.workers), "--batch-size", str(args.batch_size),
            "--max-latency", str(args.max_latency), "--init-kwargs", json.dumps({"torch_threads": 1}),
            "--log-level", "WARNING", "--log-interval", "0", MODEL]


# main ------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="rstreamer demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=positive_counts("clients"), default=None, metavar="N,N,...",
                        help="concurrent HTTP clients of each load phase, one phase after the other (default "
                             f"{','.join(map(str, LOAD_PHASES))}); with --generate, questions asked at once (the "
                             f"largest number given; default {demo_chat.ASKED}; the toy decoder: streams, default "
                             f"{demo_generate.STREAMS})")
    parser.add_argument("--callers", type=int, default=CALLERS, metavar="N",
                        help=f"concurrent callers of a last phase through the Python client (AsyncRedisStreamer), "
                             f"as a fleet of web processes would call; 0: none (default {CALLERS})")
    parser.add_argument("--seconds", type=float, default=4.0, help="length of each load phase (default 4)")
    parser.add_argument("--workers", type=int, default=2, help="embedding worker processes (default 2)")
    parser.add_argument("--web-workers", type=int, default=2, help="gunicorn worker processes (default 2)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-latency", type=float, default=0.02)
    parser.add_argument("--port", type=int, default=0, help="web port (default: a free one)")
    parser.add_argument("--output", type=Path, default=Path("demo-output"), help="where the plot goes")
    parser.add_argument("--serve", action="store_true", help="keep the stack up for manual requests until Ctrl-C")
    parser.add_argument("--generate", action="store_true",
                        help="instead: a real chat model answers questions at once, streamed (POST /generate as "
                             "Server-Sent Events and the Python client), continuously batched")
    parser.add_argument("--generate-model", metavar="package.module:Class", default=None,
                        help=f"the generative model of --generate (default: the chat model {demo_chat.MODEL}, "
                             f"SmolLM2-135M-Instruct; {demo_generate.TOY}: the toy decoder)")
    parser.add_argument("--max-tokens", type=_positive, default=demo_chat.MAX_TOKENS, metavar="N",
                        help=f"with --generate: new tokens of each answer at most (default {demo_chat.MAX_TOKENS})")
    args = parser.parse_args(argv)
    if args.clients is None and not args.generate:
        args.clients = LOAD_PHASES  # --generate picks its own default for the model it serves
    return args


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if shutil.which("rstreamer-worker", path=str(Path(sys.executable).parent)) is None:
        print("rstreamer demo: rstreamer-worker is not installed here; running it through python -c")
    FORCED.clear()
    INTERRUPTS.reset()
    previous = {signum: signal.signal(signum, INTERRUPTS) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        if args.generate:
            return demo_generate.run(args)
        return run(args)
    except KeyboardInterrupt:
        _say_stopped()
        return 130
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _say_stopped() -> None:
    """End the one line the stop signal began (stderr, as that one)."""
    if INTERRUPTS.since is None:  # not our signal: a KeyboardInterrupt raised by other means
        sys.stderr.write("rstreamer demo: interrupted; everything it started is stopped\n")
        return
    sys.stderr.write(f" done, nothing it started is left running ({time.monotonic() - INTERRUPTS.since:.1f} s)\n")
    sys.stderr.flush()


def run(args: argparse.Namespace) -> int:
    port = args.port or free_port()
    base_url = f"http://127.0.0.1:{port}"
    with contextlib.ExitStack() as stack:
        shared = open_stack(stack, f"demo-{uuid.uuid4().hex[:8]}", args.output / "stack.log")
        # Enough request threads that the web app does not bound the load's concurrency.
        threads = max(16, math.ceil(max(args.clients) / args.web_workers))
        print(f"starting {args.workers} embedding workers (rstreamer-worker {MODEL}) and gunicorn at {base_url}")
        workers = shared.children.start(worker_command(args))
        web = shared.children.start(web_command(port, args.web_workers, threads), cwd=source_root())
        wait_for_workers(shared.client, shared.keys, args.workers)
        wait_ready(base_url, [workers, web])
        if args.serve:
            dash_port = free_port()  # `rstreamer dashboard`: read-only, bound to 127.0.0.1
            shared.children.start([*console_script("rstreamer", "rstreamer.cli", "main"), "dashboard", "--port",
                                   str(dash_port)])  # its Redis: RSTREAMER_REDIS_URL in env
            return serve(base_url, args.output / "stack.log", f"http://127.0.0.1:{dash_port}/")
        return drive(args, base_url, shared)
    return 1  # not reached; ExitStack does not swallow exceptions


def drive(args: argparse.Namespace, base_url: str, stack: Stack) -> int:
    """The meaning check, then the load phases; print what they show and plot it. 0 if all held."""
    sampler = load.BatchSampler(stack.client, stack.keys)
    before = sampler.totals()[1]
    reference = load.embed_all(base_url)
    sampler.wait_for_items(before + len(reference))  # the check's batches are not the load's
    passed, checked = load.check_meaning(reference)
    print(f"\nmeaning check: {passed}/{checked} paraphrases closer than unrelated sentences "
          f"(one call of {len(reference)} sentences)")
    print(f"\nload: phases of {args.seconds:g} s; in each, N clients send one sentence each, wait for its "
          f"embedding, send the next:\nover HTTP (POST /predict to gunicorn), then"
          + (f" {args.callers} callers through the Python client" if args.callers else " no Python-client phase")
          + f"; {args.workers} embedding workers behind Redis, --batch-size {args.batch_size}")
    with sampler.sampling():
        work = load.Load(base_url, stack.url, stack.keys.prefix, args.clients, args.callers, args.seconds)
        samples, phases = run_cancellable(work.run())
        sampler.wait_for_items(before + len(reference) + sum(s.status == 200 for s in samples))
    png = args.output / "rstreamer-demo.png"
    load.plot(samples, load.batch_series(sampler.points), png, args.batch_size, phases)
    return 0 if report(args, samples, phases, sampler, reference, png) and passed == checked else 1


def report(args: argparse.Namespace, samples: list[load.Sample], phases: list[load.Phase],
           sampler: load.BatchSampler, reference: dict[str, list[float]], png: Path) -> bool:
    """Print a line per phase, the errors, why the batches are their size and where the plot is."""
    for row in load.phase_rows(samples, phases, sampler):
        print(row)
    errors = sum(s.status != 200 for s in samples)
    inconsistent = load.inconsistent(samples, reference)
    print(f"errors: {errors} of {len(samples)} requests; answers that differ from the check call's: {inconsistent}")
    print(f"\n{load.why_this_batch_size(args.workers, args.batch_size, args.max_latency)}")
    print(f"\nplot: {png.resolve()}")
    return errors == 0 and inconsistent == 0


def serve(base_url: str, log: Path, dashboard: str) -> int:
    print(f"\nthe stack is up at {base_url} (logs in {log}); try:\n"
          f"  curl -s -X POST {base_url}/predict -H 'content-type: application/json' "
          f"-d '{{\"inputs\": [\"Happy birthday to you.\"]}}' | head -c 200; echo\n"
          f"  curl -s -X POST {base_url}/predict -d 's=Happy birthday to you.' -d 's=Many happy returns.' "
          f"| head -c 200; echo\n"
          f"  curl -s {base_url}/readyz; echo\n"
          f"  curl -s {base_url}/metrics | grep rstreamer_\n"
          "press Ctrl-C to stop everything\n"
          f"live dashboard (queues, workers, dead letters): {dashboard}")
    threading.Event().wait()
    return 0


