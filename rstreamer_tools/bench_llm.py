"""`rstreamer bench llm`: a real chat model (SmolLM2-135M-Instruct), continuous against request-level batching.

The same model, the same chats — ``max_tokens`` log-uniform between 8 and 256, greedy — from 32
concurrent callers, three ways side by side in one run:

- ``request-level``: ``workers.llm:RequestLevelChat`` behind one Redis worker; the worker batches
  calls as for any model (``batch_size`` 32, ``max_latency`` 0.05 s) and runs each batch in one
  padded ``generate()`` until its longest answer is done; callers ``predict`` and get the whole
  answer then.
- ``continuous``: ``workers.llm:ChatModel`` behind one Redis worker (the generative lane): chats
  join and leave the running batch between steps and callers ``stream`` every text delta.
- ``in-process``: the same ``ChatModel`` driven in this process with the same concurrency (a
  finished chat's caller sends its next one before the next step): continuous batching without
  Redis, the ceiling of the ``continuous`` run.

It reports tokens/s (completion tokens), time to first token p50/p99 (to the first text delta;
for request-level, the whole answer), inter-token p99 (the gaps between a stream's deltas), and
the Redis share (1 - continuous / in-process tokens/s). Prints a table with the load average
and writes ``bench-llm.json`` to ``--output``. ``--chats 16`` is a quick run; ``--gpu 0`` runs
the model on GPU 0 (the workers placed there as ``--gpus 0`` does), else it runs on the CPU.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rstreamer.broker.embedded import redis_url_or_embedded
from rstreamer.ops.metrics import percentile
from rstreamer_tools.bench_stream import serving
from rstreamer_tools.threads import run_threads

CONTINUOUS = "workers.llm:ChatModel"
REQUEST_LEVEL = "workers.llm:RequestLevelChat"
RUNS = ("request-level", "continuous", "in-process")
TARGETS = {"tokens_per_s": 3.0, "ttft_p50": 10.0, "redis": 0.9}
"""Continuous batching through Redis against request-level batching: at least 3x the tokens/s and
10x lower p50 time to first token; and at least 0.9 of the in-process tokens/s."""
TOPICS = ["the sea", "a forest", "the moon", "bread", "a city at night", "rain", "mountains", "a library",
          "coffee", "the wind", "a river", "winter", "bees", "a train journey", "the desert", "music"]
ASKS = ["Tell me about {}.", "Write a short poem about {}.", "Describe {} in a few sentences.",
        "What do you know about {}?", "Give me three facts about {}."]


def workload(count: int, shortest: int, longest: int, seed: int = 0) -> list[dict[str, Any]]:
    """``count`` greedy chats whose ``max_tokens`` are log-uniform between ``shortest`` and ``longest``."""
    rng = random.Random(seed)
    items = []
    for _ in range(count):
        question = rng.choice(ASKS).format(rng.choice(TOPICS))
        tokens = int(round(shortest * (longest / shortest) ** rng.random()))
        items.append({"messages": [{"role": "user", "content": question}],
                      "max_tokens": max(shortest, min(longest, tokens)), "temperature": 0})
    return items


@dataclass
class Sample:
    """One chat: seconds from its sending to its first token and to its end, its tokens, its
    inter-token gaps (s) and its text."""

    ttft: float
    e2e: float
    tokens: int
    gaps: list[float]
    text: str


@dataclass
class Run:
    """What one run measured."""

    policy: str
    chats: int = 0
    failed: int = 0
    seconds: float = 0.0
    tokens: int = 0
    tokens_per_s: float = 0.0
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    inter_token_p99_ms: float | None = None
    e2e_p50_ms: float | None = None
    model_cpu_s: float | None = None  # CPU seconds of the process that ran the model (less noisy than wall time)
    tokens_per_cpu_s: float | None = None
    errors: list[str] = field(default_factory=list)
    samples: dict[int, Sample] = field(default_factory=dict, repr=False)


def summarize(run: Run) -> None:
    """Fill the run's figures from its samples."""
    samples = list(run.samples.values())
    run.chats = len(samples) + run.failed
    run.tokens = sum(sample.tokens for sample in samples)
    run.tokens_per_s = run.tokens / run.seconds if run.seconds else 0.0
    ttft = [sample.ttft for sample in samples]
    run.ttft_p50_ms, run.ttft_p99_ms = (_ms(percentile(ttft, q)) for q in (0.5, 0.99))
    run.e2e_p50_ms = _ms(percentile([sample.e2e for sample in samples], 0.5))
    gaps = [gap for sample in samples for gap in sample.gaps]
    run.inter_token_p99_ms = _ms(percentile(gaps, 0.99))
    if run.model_cpu_s:
        run.tokens_per_cpu_s = run.tokens / run.model_cpu_s


def cpu_seconds(pid: int) -> float | None:
    """User plus system CPU seconds of a process so far (Linux /proc); None elsewhere."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


class Clock:
    """One chat's arrivals: the first token, the gaps between tokens, the text and the final chunk."""

    def __init__(self, sent: float) -> None:
        self.sent = sent
        self.first: float | None = None
        self.last = sent
        self.gaps: list[float] = []
        self.parts: list[str] = []
        self.final: dict[str, Any] = {}

    def chunk(self, chunk: Any, now: float) -> None:
        if isinstance(chunk, dict):
            self.final = chunk
            return
        if isinstance(chunk, str):
            if self.first is None:
                self.first = now
            else:
                self.gaps.append(now - self.last)
            self.last = now
            self.parts.append(chunk)

    def sample(self, now: float) -> Sample:
        tokens = int((self.final.get("usage") or {}).get("completion_tokens", 0))
        return Sample((self.first or now) - self.sent, now - self.sent, tokens, self.gaps, "".join(self.parts))


Call = Callable[[dict[str, Any]], Sample]


def streamed_call(streamer: Any, timeout: float) -> Call:
    """A caller that streams: its first token is its first text delta."""
    def call(item: dict[str, Any]) -> Sample:
        clock = Clock(time.perf_counter())
        for chunk in streamer.stream(item, timeout=timeout):
            clock.chunk(chunk, time.perf_counter())
        return clock.sample(time.perf_counter())

    return call


def whole_call(streamer: Any, timeout: float) -> Call:
    """A caller that waits for the whole answer: its first token comes with its last."""
    def call(item: dict[str, Any]) -> Sample:
        sent = time.perf_counter()
        [answer] = streamer.predict([item], timeout=timeout)
        end = time.perf_counter()
        return Sample(end - sent, end - sent, int(answer["usage"]["completion_tokens"]), [], answer["text"])

    return call


def drive(call: Call, items: list[dict[str, Any]], callers: int, run: Run, model_pid: int | None = None) -> None:
    """``callers`` threads take the chats in turn, one call at a time each; fills ``run`` (and the
    CPU time of ``model_pid``, the worker process, meanwhile)."""
    counter = itertools.count()
    lock = threading.Lock()

    def caller() -> None:
        while (index := next(counter)) < len(items):
            try:
                sample = call(items[index])
            except Exception as exc:
                with lock:
                    run.failed += 1
                    run.errors.append(f"{type(exc).__name__}: {exc}"[:200])
                continue
            with lock:
                run.samples[index] = sample

    cpu = cpu_seconds(model_pid) if model_pid else None
    run.seconds = run_threads(caller, callers)
    after = cpu_seconds(model_pid) if model_pid else None
    if cpu is not None and after is not None:
        run.model_cpu_s = after - cpu
    summarize(run)


def through_redis(policy: str, args: argparse.Namespace, items: list[dict[str, Any]]) -> Run:
    """One worker process of the policy's model behind Redis; the callers stream or predict."""
    run = Run(policy)
    model = CONTINUOUS if policy == "continuous" else REQUEST_LEVEL
    with serving(model, 1, args) as (streamer, supervisor):
        call = (streamed_call if policy == "continuous" else whole_call)(streamer, args.timeout)
        drive(call, _warm_up(items), min(args.callers, 4), Run(policy))
        drive(call, items, args.callers, run, model_pid=supervisor.pids[0])
    return run


def _warm_up(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**item, "max_tokens": 4} for item in items[:4]]


def in_process(args: argparse.Namespace, items: list[dict[str, Any]]) -> Run:
    """The same model and concurrency without Redis: a finished chat's caller sends its next one,
    which joins the batch before the next step."""
    from workers.llm import ChatModel

    model = ChatModel()
    device = "cpu" if args.gpu is None else f"cuda:{args.gpu}"
    model.init_model(**args.model_kwargs, device=device)
    run = Run("in-process")
    _loop(model, _warm_up(items), min(args.callers, 4), Run("in-process"))
    began, cpu = time.perf_counter(), time.process_time()
    _loop(model, items, args.callers, run)
    run.seconds, run.model_cpu_s = time.perf_counter() - began, time.process_time() - cpu
    summarize(run)
    return run


def _loop(model: Any, items: list[dict[str, Any]], callers: int, run: Run) -> None:
    waiting = iter(range(len(items)))
    clocks: dict[int, Clock] = {}
    now = time.perf_counter()
    sent = {index: now for index in itertools.islice(waiting, callers)}
    while sent or clocks:
        if sent:
            model.start({index: items[index] for index in sent})
            clocks.update({index: Clock(at) for index, at in sent.items()})
            sent = {}
        outputs = model.step()
        now = time.perf_counter()
        for index, step in outputs.items():
            for chunk in step.chunks:
                clocks[index].chunk(chunk, now)
            if step.finished:
                run.samples[index] = clocks.pop(index).sample(now)
                following = next(waiting, None)
                if following is not None:
                    sent[following] = now


def ratios(runs: Sequence[Run]) -> dict[str, float]:
    """Continuous against request-level (tokens/s, lower p50 time to first token) and against in-process."""
    by = {run.policy: run for run in runs}
    out: dict[str, float] = {}
    continuous, base, ceiling = by.get("continuous"), by.get("request-level"), by.get("in-process")
    if continuous and base and base.tokens_per_s and continuous.ttft_p50_ms:
        out["tokens_per_s"] = continuous.tokens_per_s / base.tokens_per_s
        out["ttft_p50"] = (base.ttft_p50_ms or 0.0) / continuous.ttft_p50_ms
    if continuous and ceiling and ceiling.tokens_per_s:
        out["redis"] = continuous.tokens_per_s / ceiling.tokens_per_s
    return out


def cpu_ratios(runs: Sequence[Run]) -> dict[str, float]:
    """The same ratios in tokens per CPU second of the model's process (what a busy machine
    disturbs less than wall time)."""
    by = {run.policy: run.tokens_per_cpu_s for run in runs}
    out: dict[str, float] = {}
    continuous, base, ceiling = by.get("continuous"), by.get("request-level"), by.get("in-process")
    if continuous and base:
        out["tokens_per_s"] = continuous / base
    if continuous and ceiling:
        out["redis"] = continuous / ceiling
    return out


def check_targets(runs: Sequence[Run]) -> list[str]:
    """One line per reference point: reached or not, with the measured ratio."""
    names = {"tokens_per_s": "continuous tokens/s over request-level",
             "ttft_p50": "request-level p50 time to first token over continuous",
             "redis": "continuous through Redis over in-process tokens/s"}
    lines = []
    for key, value in ratios(runs).items():
        verdict = "reached    " if value >= TARGETS[key] else "not reached"
        lines.append(f"{verdict}  {names[key]}: x{value:.2f} (reference >= x{TARGETS[key]:g})")
    share = ratios(runs).get("redis")
    if share is not None:
        lines.append(f"Redis share of the continuous run's time: {max(0.0, 1 - share):.0%}")
    per_cpu = cpu_ratios(runs)
    if per_cpu:
        lines.append("per CPU second of the model's process: "
                     + ", ".join(f"{names[key]} x{value:.2f}" for key, value in per_cpu.items()))
    return lines


def format_table(runs: Sequence[Run]) -> str:
    """The runs side by side."""
    header = ("batching", "chats", "tokens", "tokens/s", "1st token p50 ms", "p99 ms", "inter-token p99 ms",
              "e2e p50 ms", "tokens/CPU-s", "failed")
    rows = [header]
    for run in runs:
        rows.append((run.policy, str(run.chats), f"{run.tokens:,}", f"{run.tokens_per_s:,.1f}",
                     _cell(run.ttft_p50_ms), _cell(run.ttft_p99_ms),
                     _cell(run.inter_token_p99_ms, "all at once"), _cell(run.e2e_p50_ms),
                     "-" if run.tokens_per_cpu_s is None else f"{run.tokens_per_cpu_s:,.1f}", str(run.failed)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)) for row in rows)


def _cell(value: float | None, none: str = "-") -> str:
    return none if value is None else f"{value:,.0f}"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line of ``rstreamer bench llm``."""
    parser = argparse.ArgumentParser(prog="rstreamer bench llm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--chats", type=int, default=64, help="chats per run (16: a quick run)")
    parser.add_argument("--callers", type=int, default=32, help="concurrent callers")
    parser.add_argument("--shortest", type=int, default=8, help="fewest max_tokens of a chat")
    parser.add_argument("--longest", type=int, default=256, help="most max_tokens of a chat")
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, of {', '.join(RUNS)}")
    parser.add_argument("--max-latency", type=float, default=0.05, help="request-level batching's max_latency")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds a call may take")
    parser.add_argument("--gpu", type=int, default=None,
                        help="run the model on this GPU (the workers placed there as by --gpus); default: the CPU")
    parser.add_argument("--output", type=Path, default=Path("bench-output"))
    args = parser.parse_args(argv)
    args.max_active = args.callers  # live sequences of the continuous worker, batch size of the other
    args.model_kwargs = {"threads": 1}
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Every run in turn; print, check the targets, save. 0 unless a chat failed (the speed
    targets are reported, not enforced: they depend on the machine)."""
    args = parse_args(argv)
    if args.gpu is not None:
        import torch

        if not 0 <= args.gpu < torch.cuda.device_count():
            raise SystemExit(f"rstreamer bench llm: --gpu {args.gpu}, but torch sees {torch.cuda.device_count()} "
                             "CUDA device(s) here")
    chosen = [name.strip() for name in args.runs.split(",") if name.strip()]
    unknown = sorted(set(chosen) - set(RUNS))
    if unknown:
        raise SystemExit(f"rstreamer bench llm: unknown run(s) {', '.join(unknown)}; choose from {', '.join(RUNS)}")
    items = workload(args.chats, args.shortest, args.longest)
    load_before = os.getloadavg()
    runs: list[Run] = []
    with redis_url_or_embedded(lambda url: None) as args.url:
        for policy in chosen:
            run = in_process(args, items) if policy == "in-process" else through_redis(policy, args, items)
            print(f"[bench llm] {policy}: {run.tokens_per_s:,.1f} tokens/s, first token p50 "
                  f"{run.ttft_p50_ms or 0:,.0f} ms, {run.failed} failed; load average {os.getloadavg()[0]:.2f}",
                  flush=True)
            runs.append(run)
    load_after = os.getloadavg()
    print(format_table(runs))
    print("\n".join(check_targets(runs)))
    print(f"{os.cpu_count()} CPUs; load average {load_before[0]:.2f} before, {load_after[0]:.2f} after")
    args.output.mkdir(parents=True, exist_ok=True)
    path = args.output / "bench-llm.json"
    document = {"args": {k: str(v) for k, v in vars(args).items()}, "load_average": [load_before, load_after],
                "ratios": ratios(runs), "ratios_per_cpu_s": cpu_ratios(runs),
                "runs": [{k: v for k, v in asdict(run).items() if k != "samples"} for run in runs]}
    path.write_text(json.dumps(document, indent=2))
    print(f"wrote {path}")
    return 1 if any(run.failed for run in runs) else 0


if __name__ == "__main__":
    raise SystemExit(main())
