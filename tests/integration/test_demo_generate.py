"""`rstreamer demo --generate` end to end with the real chat model (SmolLM2-135M-Instruct): it
answers (Paris), says what the model is and what the run showed, and leaves nothing running; a
first run says that it converts the weights and keeps saying that it loads; Ctrl-C stops it in
one line, mid-answer and mid-load; the toy decoder stays behind --generate-model.

The worker loads the converted weights from the cache the chat model's tests fill (the first
load of a fresh machine converts them: about a minute)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from rstreamer.broker.embedded import EmbeddedRedis
from support import procs
from support.keyleaks import assert_left_clean
from support.polling import wait_until
from support.procs import processes_with

BIN = Path(sys.executable).parent
MARKER = "RSTREAMER_TEST_MARK"


def flat(text: str) -> str:
    """The demo wraps its paragraphs: compare on single spaces."""
    return " ".join(text.split())


def demo_env(marker: str) -> dict[str, str]:
    """The test environment, with a marker that every process the demo starts inherits."""
    return {**procs.test_env(), MARKER: marker}


def assert_nothing_left(marker: str) -> None:
    # SIGKILLed children vanish when the kernel reaps them: seconds on a loaded machine
    wait_until(lambda: not processes_with(marker), timeout=30, what="every process of the demo gone")


def kill_left(demo: subprocess.Popen[bytes], marker: str) -> None:
    if demo.poll() is None:
        os.killpg(demo.pid, signal.SIGKILL)
    demo.wait(timeout=10)
    for pid in processes_with(marker):
        os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(600)
def test_the_chat_model_answers_the_demo_explains_what_it_shows_and_cleans_up(tmp_path):
    marker = uuid.uuid4().hex
    with EmbeddedRedis() as server:
        env = {**demo_env(marker), "RSTREAMER_REDIS_URL": server.url}
        result = subprocess.run(
            [str(BIN / "rstreamer"), "demo", "--generate", "--clients", "3", "--max-tokens", "24",
             "--output", str(tmp_path)],
            cwd=procs.ROOT, env=env, capture_output=True, text=True, timeout=580,
        )
        out = result.stdout
        assert result.returncode == 0, out + result.stderr
        text = flat(out)
        # What the model is, before the wait for it.
        about = text.index("The model is SmolLM2-135M-Instruct: a small instruction-tuned chat model (135 million "
                           "parameters), run here on the CPU")
        assert "may be wrong on hard ones" in text
        assert about < text.index("loading the model") < text.index("loaded in") < text.index("Q: ")
        # The first answer streams over HTTP; greedy, it names the capital.
        france = re.search(r"^Q: What is the capital of France\?\nA: (.*)\n\s+(finish_reason .*)$", out, re.M)
        assert france, out
        assert "Paris" in france.group(1), france.group(1)
        assert re.match(r"finish_reason stop; usage: \d+ prompt \+ \d+ completion = \d+ tokens; first token after "
                        r"[\d.]+ s", france.group(2)), france.group(2)
        assert len(re.findall(r"^Q: ", out, re.M)) == 3, out
        # 24 tokens are too few for the third answer: it ends on length, and says so.
        assert "finish_reason length; usage: " in text, out
        assert re.search(r"- 3 answers at once: \d+ new tokens in [\d.]+ s, [\d.]+ tokens/s together", text), out
        assert re.search(r"- time to first token: [\d.]+ s to [\d.]+ s", text), out
        shares = re.search(r"answers per step: (.*?) \(mean ([\d.]+)\)\. That is continuous batching", text)
        assert shares, out
        # The questions were asked together: some steps advanced several answers at once.
        assert re.search(r"\b[23] in [1-9]", shares.group(1)) and float(shares.group(2)) > 1, shares.group(0)
        assert "finish_reason stop: the model ended its answer; length: it reached max_tokens (24 here" in text
        assert_left_clean(server.url)
        assert_nothing_left(marker)


def start_demo(tmp_path: Path, marker: str, *args: str, **env: str) -> subprocess.Popen[bytes]:
    environ = {**demo_env(marker), **env}
    environ.pop("RSTREAMER_REDIS_URL", None)  # its own embedded Redis: one more thing it must stop
    with (tmp_path / "out.log").open("wb") as stdout, (tmp_path / "err.log").open("wb") as stderr:
        return subprocess.Popen([str(BIN / "rstreamer"), "demo", "--generate", "--output", str(tmp_path), *args],
                                cwd=procs.ROOT, env=environ, stdout=stdout, stderr=stderr, start_new_session=True)


def interrupt_and_check(demo: subprocess.Popen[bytes], tmp_path: Path, marker: str) -> None:
    """Ctrl-C: exit 130 in one line of stderr, no traceback, nothing left running."""
    sent = time.monotonic()
    demo.send_signal(signal.SIGINT)
    # A generous bound against a hang, not a speed test: it stops in a few seconds.
    assert demo.wait(timeout=60) == 130
    took = time.monotonic() - sent
    out, err = (tmp_path / "out.log").read_text(), (tmp_path / "err.log").read_text()
    assert "Traceback" not in out + err, out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("rstreamer demo: interrupted; stopping everything it started") and \
        "done, nothing it started is left running" in lines[0], lines[0]
    print(f"stopped {took:.1f} s after SIGINT: {lines[0]}")
    assert_nothing_left(marker)


@pytest.mark.timeout(400)
def test_ctrl_c_while_the_answers_stream_stops_everything_in_one_line(tmp_path):
    marker = uuid.uuid4().hex
    # 256 tokens: the longer answers go on for many steps after the first one is printed.
    demo = start_demo(tmp_path, marker, "--max-tokens", "256")
    try:
        wait_until(lambda: "Paris" in (tmp_path / "out.log").read_text(), timeout=300,
                   what="the first answer streaming", alive=lambda: demo.poll() is None)
        assert "what this shows" not in (tmp_path / "out.log").read_text()
        interrupt_and_check(demo, tmp_path, marker)
    finally:
        kill_left(demo, marker)


@pytest.mark.timeout(300)
def test_a_first_run_says_it_converts_the_weights_keeps_saying_it_loads_and_stops_on_ctrl_c(tmp_path):
    marker = uuid.uuid4().hex
    # An empty cache: the worker converts the GGUF weights, as on a fresh machine.
    demo = start_demo(tmp_path, marker, RSTREAMER_LLM_CACHE=str(tmp_path / "llm-cache"))
    try:
        out = tmp_path / "out.log"
        wait_until(lambda: "still loading (" in out.read_text(), timeout=200, what="a line while it loads",
                   alive=lambda: demo.poll() is None)
        text = flat(out.read_text())
        note = ("this run converts its weights from the GGUF file to float32 (about a minute, several on a busy "
                f"machine) then saves them in {tmp_path / 'llm-cache'}, so that later runs load in about 10 s")
        assert note in text, text
        assert "loaded in" not in text
        interrupt_and_check(demo, tmp_path, marker)
    finally:
        kill_left(demo, marker)


@pytest.mark.timeout(300)
def test_the_toy_decoder_streams_checks_and_cleans_up(tmp_path: Path) -> None:
    with EmbeddedRedis() as server:
        env = procs.test_env()
        env["RSTREAMER_REDIS_URL"] = server.url
        result = subprocess.run(
            [str(BIN / "rstreamer"), "demo", "--generate", "--generate-model", "workers.decoder:TinyDecoder",
             "--clients", "4", "--output", str(tmp_path)],
            cwd=procs.ROOT, env=env, capture_output=True, text=True, timeout=280,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        # The toy decoder's text is gibberish: the demo says so before it shows any.
        note = result.stdout.index("The decoder is a toy: a small Transformer with random weights")
        assert note < result.stdout.index("POST /generate") and "gibberish by design" in result.stdout
        assert "64 chunks as Server-Sent Events" in result.stdout
        assert "joined: yes; every stream complete: yes" in result.stdout
        assert_left_clean(server.url)
