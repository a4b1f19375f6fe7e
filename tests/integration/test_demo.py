"""`rstreamer demo` end to end, small: it must answer correctly, show and explain its batches,
write its plot, stop at once and in one line on Ctrl-C, and leave nothing running."""
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
import redis

from rstreamer.broker.embedded import EmbeddedRedis
from rstreamer.wire.keys import Keys
from rstreamer.wire.published import fleet_totals
from support import procs
from support.keyleaks import assert_left_clean
from support.polling import wait_until
from support.procs import processes_with

BIN = Path(sys.executable).parent
# One row of the summary per load phase: clients, via, answered, requests/s, p50, p99, in Redis, mean batch.
ROW = re.compile(r"^\s+(\d+)\s+(HTTP|client)\s+(\d+)\s+[\d.]+\s+\S+\s+\S+\s+\d+\s+([\d.]+|nan)$", re.M)


# The one test that imports torch in a worker, starts gunicorn and stops both through the CLI:
# on a busy shared machine that alone can approach the suite's 60 s default.
@pytest.mark.timeout(150)
def test_demo_runs_checks_explains_its_batches_plots_and_cleans_up(tmp_path):
    with EmbeddedRedis() as server:
        env = procs.test_env()
        env["RSTREAMER_REDIS_URL"] = server.url
        # Without grouping texts by length, the batches are bounded by the callers alone.
        env["RSTREAMER_COST_LOOKAHEAD"] = "1"
        result = subprocess.run(
            [str(BIN / "rstreamer"), "demo", "--clients", "1,4", "--callers", "32", "--seconds", "2",
             "--workers", "1", "--web-workers", "1", "--batch-size", "8", "--output", str(tmp_path)],
            cwd=procs.ROOT, env=env, capture_output=True, text=True, timeout=140,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        assert "meaning check: 20/20 paraphrases closer" in result.stdout
        assert re.search(r"errors: 0 of \d+ requests; answers that differ from the check call's: 0", result.stdout)
        rows = [(int(clients), via, int(answered), float(batch))
                for clients, via, answered, batch in ROW.findall(result.stdout)]
        assert [(clients, via) for clients, via, _, _ in rows] == [(1, "HTTP"), (4, "HTTP"), (32, "client")], \
            result.stdout
        assert all(answered > 0 for _, _, answered, _ in rows), result.stdout
        # One client at a time: one item per batch. 32 callers for 1 worker of batch size 8: full batches.
        assert rows[0][3] <= 1.5 and rows[2][3] >= 4, result.stdout
        assert "Why the batches are this size" in result.stdout and "N clients keep at most N items" in result.stdout
        assert (tmp_path / "rstreamer-demo.png").stat().st_size > 10_000
        assert_left_clean(server.url)


def demo_prefix(client: redis.Redis) -> str | None:
    """The prefix whose workers heart-beat in this Redis (the demo's), once there is one."""
    for key in client.scan_iter(match="rstreamer:{demo-*}:workers"):
        return key.decode().split("{", 1)[1].split("}", 1)[0]
    return None


@pytest.mark.timeout(150)
def test_ctrl_c_in_the_middle_of_the_load_stops_everything_in_one_line(tmp_path):
    marker = f"RSTREAMER_TEST_MARK=demo-{uuid.uuid4().hex}"
    out, err = tmp_path / "out.log", tmp_path / "err.log"
    env = {**procs.test_env(), marker.split("=")[0]: marker.split("=")[1]}
    env.pop("RSTREAMER_REDIS_URL", None)  # its own embedded Redis: one more thing it must stop
    with out.open("wb") as stdout, err.open("wb") as stderr:
        demo = subprocess.Popen(
            # 32 clients of 2 workers keep the event loop busy: a stop raised inside it used to leave
            # tasks that printed ~100 lines of traceback at exit.
            [str(BIN / "rstreamer"), "demo", "--clients", "32", "--seconds", "300", "--workers", "2",
             "--web-workers", "2", "--output", str(tmp_path)],
            cwd=procs.ROOT, env=env, stdout=stdout, stderr=stderr, start_new_session=True)
    try:
        url = wait_until(lambda: re.search(r"started an embedded Redis at (\S+)", out.read_text()), timeout=60,
                         what="the demo's Redis", alive=lambda: demo.poll() is None).group(1)
        wait_until(lambda: "load: phases" in out.read_text(), timeout=120, what="the load starting",
                   alive=lambda: demo.poll() is None)
        client = redis.Redis.from_url(url)
        try:
            # Answers flow: the HTTP clients are in the middle of their requests on the event loop.
            prefix = wait_until(lambda: demo_prefix(client), timeout=30, what="the demo's prefix")
            done = fleet_totals(client, Keys(prefix)).items
            wait_until(lambda: fleet_totals(client, Keys(prefix)).items > done + 20, timeout=60,
                       what="the load's answers", alive=lambda: demo.poll() is None)
        finally:
            client.close()
        sent = time.monotonic()
        demo.send_signal(signal.SIGINT)
        # A generous bound against a hang, not a speed test: it stops in a few seconds.
        assert demo.wait(timeout=60) == 130
        took = time.monotonic() - sent
        stderr_text = err.read_text()
        assert "Traceback" not in stderr_text + out.read_text(), stderr_text
        lines = stderr_text.strip().splitlines()
        assert len(lines) == 1, stderr_text
        assert lines[0].startswith("rstreamer demo: interrupted; stopping everything it started") and \
            "done, nothing it started is left running" in lines[0], lines[0]
        print(f"stopped {took:.1f} s after SIGINT: {lines[0]}")
        # SIGKILLed children vanish when the kernel reaps them: seconds on a loaded machine
        wait_until(lambda: not processes_with(marker), timeout=20, what="every process of the demo gone")
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
        demo.wait(timeout=10)
        for pid in processes_with(marker):
            os.kill(pid, signal.SIGKILL)
