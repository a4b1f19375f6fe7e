"""`rstreamer bench instructions` in a tiny configuration: a count per phase that does not move
between two runs of the same tree, and one that does when a script does more."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rstreamer_tools import bench
from support.system import require_debian_tool

pytestmark = pytest.mark.integration

REPOSITORY = Path(__file__).resolve().parents[2]


@pytest.fixture
def valgrind() -> None:
    require_debian_tool("valgrind", "valgrind")
    require_debian_tool("callgrind_control", "valgrind")


def test_bench_instructions_counts_each_phase_alike_twice_and_sees_a_script_that_does_more(valgrind, tmp_path):
    heavier = tmp_path / "heavier"
    shutil.copytree(REPOSITORY / "rstreamer", heavier / "rstreamer", ignore=shutil.ignore_patterns("__pycache__"))
    finish = heavier / "rstreamer" / "wire" / "lua" / "finish.lua"
    # The same FINISH, with a thousand more additions of Lua per call.
    heavier_end = "\nlocal n = 0\nfor i = 1, 1000 do n = n + i end\nreturn 1"
    finish.write_text(finish.read_text().replace("\nreturn 1", heavier_end))
    argv = ["instructions", "--cycles", "20", "--group", "4", "--groups", "2", "--output", str(tmp_path),
            "--tree", str(REPOSITORY), "--tree", str(REPOSITORY), "--tree", str(heavier)]
    assert bench.main(argv) == 0
    first, again, more = (
        {phase: row[phase] for phase in ("ENQUEUE", "XREADGROUP", "FINISH", "BLPOP")}
        for row in json.loads((tmp_path / "bench-instructions.json").read_text())["rows"])
    assert all(count > 0 for count in first.values())
    assert first["ENQUEUE"] > first["XREADGROUP"] > first["BLPOP"]  # a script and a read per item, a pop per call
    for phase, count in first.items():
        assert abs(again[phase] / count - 1) < 0.03, (phase, count, again[phase])
    # 1000 loop iterations per FINISH of 8 items: thousands of instructions per item more.
    assert more["FINISH"] - first["FINISH"] > 1000
    assert abs(more["ENQUEUE"] / first["ENQUEUE"] - 1) < 0.02
