"""The supervisor's liveness stamp, read by `rstreamer-worker --check --liveness`: local, no Redis."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import pytest

from rstreamer import cli
from rstreamer.worker import alive


@pytest.fixture(autouse=True)
def private_tmp(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_fresh_stamp_of_a_running_supervisor_is_alive():
    stamp = alive.AliveStamp("p")
    assert alive.check_alive("p")[0] is False, "not stamped yet"
    stamp.touch()
    healthy, message = alive.check_alive("p")
    assert healthy and f"supervisor pid {os.getpid()}" in message
    assert not alive.check_alive("other")[0], "another prefix's supervisor does not count"
    stamp.remove()
    assert alive.check_alive("p") == (False, f"no supervisor of prefix 'p' runs here (no liveness file in "
                                             f"{tempfile.gettempdir()})")


def test_a_stamp_older_than_the_bound_is_a_hung_supervisor():
    stamp = alive.AliveStamp("p")
    stamp.touch()
    old = time.time() - alive.STALE_AFTER - 5
    os.utime(stamp.path, (old, old))
    healthy, message = alive.check_alive("p")
    assert not healthy and "stamped 65s ago" in message, message
    stamp.touch()
    assert alive.check_alive("p")[0]


def test_the_stamp_of_a_killed_supervisor_does_not_count_and_is_pruned(private_tmp):
    pid = dead_pid()
    alive.AliveStamp("p", pid=pid).touch()
    healthy, message = alive.check_alive("p")
    assert not healthy and f"pid {pid}" in message and "gone" in message
    alive.AliveStamp("p")  # the next supervisor of the prefix on this machine
    assert not list(private_tmp.glob("*.alive"))


def test_an_unwritable_stamp_is_logged_once_not_raised(private_tmp, caplog):
    stamp = alive.AliveStamp("p")
    stamp.path = private_tmp / "gone" / stamp.path.name  # a directory that does not exist
    stamp.touch()
    stamp.touch()
    assert [r.levelname for r in caplog.records] == ["ERROR"] and "TMPDIR" in caplog.text


def test_check_liveness_needs_no_redis_and_refuses_a_bad_prefix():
    args = cli.parse_worker_args(["--check", "--liveness", "--redis", "redis://127.0.0.1:1/0", "--prefix", "p",
                                  "no_such_module:Model"], {})
    alive.AliveStamp("p").touch()
    assert cli.check_liveness(args)[0], "neither Redis (nothing on port 1) nor the model import is checked"
    args.prefix = "a b"
    healthy, message = cli.check_liveness(args)
    assert not healthy and "invalid prefix" in message
