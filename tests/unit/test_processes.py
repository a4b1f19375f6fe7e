"""Stopping the developer tools' child process groups: all at once, and nothing left behind."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

from rstreamer_tools.processes import stop_groups
from support.polling import wait_until

# Records when SIGTERM came, then ignores it: only SIGKILL ends it.
STUBBORN = textwrap.dedent("""
    import signal, sys, time
    def term(signum, frame):
        open(sys.argv[1], "w").write(repr(time.time()))
    signal.signal(signal.SIGTERM, term)
    open(sys.argv[1] + ".ready", "w").close()
    while True:
        time.sleep(0.05)
""")


def test_every_group_is_told_to_stop_at_once_then_killed(tmp_path: Path):
    marks = [tmp_path / f"term-{n}" for n in range(3)]
    processes = [subprocess.Popen([sys.executable, "-c", STUBBORN, str(mark)], start_new_session=True)
                 for mark in marks]
    try:
        wait_until(lambda: all(Path(f"{mark}.ready").exists() for mark in marks), timeout=30, what="children up")
        grace = 2.0
        stop_groups(processes, grace)
        assert all(process.returncode == -9 for process in processes), "they ignore SIGTERM: killed after the grace"
        terms = [float(mark.read_text()) for mark in marks]
        # One after the other, each would have had its SIGTERM a grace after the previous one.
        assert max(terms) - min(terms) < grace / 2, terms
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()


def test_a_group_that_stops_by_itself_is_not_waited_for(tmp_path: Path):
    quick = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    started = time.monotonic()
    stop_groups([quick], grace=30.0)
    assert quick.returncode == -15  # SIGTERM's default action
    assert time.monotonic() - started < 25, "the grace is an upper bound, not a wait"
