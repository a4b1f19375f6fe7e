"""`rstreamer demo --generate`: streamed answers of a generative model, continuously batched.

Redis (embedded unless RSTREAMER_REDIS_URL is set), one ``rstreamer-worker`` serving a
generative model and the Flask app under gunicorn.

By default the model is ``workers.llm:ChatModel``, SmolLM2-135M-Instruct on the CPU: a few short
questions at once, the first streamed over HTTP (``POST /generate``, Server-Sent Events) as its
answer is made, the others through ``RedisStreamer.stream``; then tokens/s, time to first token,
finish_reason and usage, and how many answers shared each model step
(:mod:`rstreamer_tools.demo_chat`). Its first run converts the model's weights (about a minute);
the demo says so while it waits.

``--generate-model workers.decoder:TinyDecoder`` serves the toy decoder instead: random weights
from a fixed seed, greedy, whose text is gibberish by design (the demo says so); it streams one
answer over HTTP, then concurrent streams of mixed lengths through the client, and checks that
``predict()`` of the same item returns the same text, joined. Any other ``--generate-model`` is
asked chat items, as the chat model is (see docs/streaming.md, "The chat model").
"""
from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import textwrap
import threading
import time
import uuid

from rstreamer.broker.embedded import free_port
from rstreamer_tools import demo_chat
from rstreamer_tools.stack import (
    STARTUP_TIMEOUT,
    Stack,
    console_script,
    open_stack,
    source_root,
    wait_for_workers,
    wait_ready,
    web_command,
)

#: The generative model the demo serves, unless --generate-model names another.
MODEL = demo_chat.MODEL
TOY = "workers.decoder:TinyDecoder"
#: What to tell the reader about a model whose output is not meant to make sense.
TOY_MODELS = {
    TOY:
        "The decoder is a toy: a small Transformer with random weights (nothing is downloaded), so its "
        "text is gibberish by design. What matters here is how the answer streams and how the worker "
        "batches the streams; without --generate-model the demo serves a real chat model the same way.",
}
PROMPT = {"prompt": "Once upon a time", "max_new_tokens": 64}
STREAMS = 32  # concurrent streams of the toy decoder


def worker_command(model: str, max_active: int, metrics_port: int | None = None) -> list[str]:
    metrics = ["--metrics-port", str(metrics_port)] if metrics_port is not None else []
    return [*console_script("rstreamer-worker", "rstreamer.cli", "worker_main"), "--batch-size", str(max_active),
            *metrics, "--log-level", "WARNING", "--log-interval", "0", model]


def run(args: argparse.Namespace) -> int:
    """Start the stack and show the model's answers; 0 if every check held."""
    model = args.generate_model or MODEL
    toy = model in TOY_MODELS
    if not toy:
        demo_chat.check_installed(model)
    port = args.port or free_port()
    base_url = f"http://127.0.0.1:{port}"
    with contextlib.ExitStack() as stack:
        shared = open_stack(stack, f"demo-generate-{uuid.uuid4().hex[:8]}", args.output / "stack-generate.log")
        print(f"starting a worker of a generative model (rstreamer-worker {model}) and gunicorn at {base_url}")
        metrics_port = None if toy else free_port()
        shared.children.start(worker_command(model, args.batch_size, metrics_port))
        shared.children.start(web_command(port, 1), cwd=source_root())
        if toy:
            wait_for_workers(shared.client, shared.keys, 1, children=shared.children)
        else:
            demo_chat.wait_loaded(shared, model, args.output / "stack-generate.log")
        wait_ready(base_url, shared.children.processes, STARTUP_TIMEOUT)
        if not toy:
            return demo_chat.show(base_url, shared.url, shared.keys.prefix, f"http://127.0.0.1:{metrics_port}/metrics",
                                  max(args.clients or [demo_chat.ASKED]), args.max_tokens)
        return run_toy(model, base_url, shared, max(args.clients or [STREAMS]))
    return 1  # not reached; ExitStack does not swallow exceptions


def run_toy(model: str, base_url: str, shared: Stack, streams: int) -> int:
    """The toy decoder: one stream over HTTP, then ``streams`` at once through the client."""
    print(f"\n{textwrap.fill(TOY_MODELS[model], 96)}")
    text = stream_over_http(base_url)
    return 0 if concurrent_streams(shared.url, shared.keys.prefix, streams, text) else 1


def stream_over_http(base_url: str) -> str:
    """``POST /generate``: print each chunk as its event arrives; the streamed text."""
    import httpx

    print(f"\nPOST /generate {json.dumps({'input': PROMPT})}\n  {PROMPT['prompt']!r} ->", end=" ", flush=True)
    parts: list[str] = []
    sent = time.perf_counter()
    first = None
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{base_url}/generate", json={"input": PROMPT}) as r:
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: ") and name == "chunk":
                chunk = json.loads(line[len("data: "):])
                first = first or time.perf_counter()
                parts.append(chunk)
                sys.stdout.write(chunk)
                sys.stdout.flush()
            elif name in ("end", "error"):
                break
    total = time.perf_counter() - sent
    print(f"\n  {len(parts)} chunks as Server-Sent Events; first after {((first or sent) - sent) * 1000:.0f} ms, "
          f"last after {total * 1000:.0f} ms")
    return "".join(parts)


def concurrent_streams(url: str, prefix: str, clients: int, http_text: str) -> bool:
    """``clients`` streams of mixed lengths at once; print a line per stream as it ends, then a summary."""
    from rstreamer import RedisStreamer

    rng = random.Random(0)
    lengths = [int(4 * 32 ** rng.random()) for _ in range(clients)]
    items = [{"prompt": f"story {n}", "max_new_tokens": lengths[n]} for n in range(clients)]
    results: dict[int, tuple[float, float, int]] = {}
    lock = threading.Lock()
    print(f"\n{clients} streams at once (max_new_tokens 4..128), continuously batched by one worker:")

    def call(n: int, streamer: RedisStreamer) -> None:
        sent = time.perf_counter()
        first = None
        count = 0
        for _ in streamer.stream(items[n], timeout=120):
            first = first or time.perf_counter()
            count += 1
        done = time.perf_counter()
        with lock:
            results[n] = ((first or done) - sent, done - sent, count)
            print(f"  stream {n:2d}: {count:3d} chunks, first after {results[n][0] * 1000:5.0f} ms, "
                  f"done after {results[n][1] * 1000:6.0f} ms", flush=True)

    with RedisStreamer(url, prefix) as streamer:
        started = time.perf_counter()
        # Daemon threads: a Ctrl-C ends the demo while they wait for chunks (the stop ends their streams).
        threads = [threading.Thread(target=call, args=(n, streamer), daemon=True) for n in range(clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(180)
        elapsed = time.perf_counter() - started
        joined = streamer.predict([PROMPT], timeout=60)[0]
    firsts = sorted(first for first, _, _ in results.values())
    tokens = sum(count for _, _, count in results.values())
    # At most max_new_tokens chunks each: a real model may end its answer early.
    complete = len(results) == clients and all(0 < results[n][2] <= lengths[n] for n in results)
    print(f"\n{tokens} chunks in {elapsed:.1f} s ({tokens / elapsed:,.0f}/s); first chunk p50 "
          f"{firsts[len(firsts) // 2] * 1000:.0f} ms: short answers end early and new ones join between steps")
    same = joined == http_text
    print(f"predict() of the same prompt returns the streamed text, joined: {'yes' if same else 'NO'}; "
          f"every stream complete: {'yes' if complete else 'NO'}")
    return same and complete

