"""`rstreamer bench instructions` in a small configuration: counts that do not move between two
runs of the same tree, and that move in the phase of a script that does more."""
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


def test_bench_instructions_counts_a_tree_alike_twice_and_sees_a_script_that_does_more(valgrind, tmp_path):
    heavier = tmp_path / "heavier"
    shutil.copytree(REPOSITORY / "rstreamer", heavier / "rstreamer", ignore=shutil.ignore_patterns("__pycache__"))
    finish = heavier / "rstreamer" / "wire" / "lua" / "finish.lua"
    # The same FINISH, with 20,000 more additions of Lua per call.
    heavier_end = "\nlocal n = 0\nfor i = 1, 20000 do n = n + i end\nreturn 1"
    finish.write_text(finish.read_text().replace("\nreturn 1", heavier_end))
    argv = ["instructions", "--cycles", "40", "--group", "16", "--groups", "1", "--output", str(tmp_path),
            "--tree", str(REPOSITORY), "--tree", str(REPOSITORY), "--tree", str(heavier)]
    assert bench.main(argv) == 0
    first, again, more = (
        {phase: row[phase] for phase in ("ENQUEUE", "XREADGROUP", "FINISH", "BLPOP")}
        for row in json.loads((tmp_path / "bench-instructions.json").read_text())["rows"])
    assert all(count > 0 for count in first.values())
    assert first["ENQUEUE"] > first["XREADGROUP"] > first["BLPOP"]  # a script and a read per item, a pop per call
    # Counted, not timed: the same tree twice within 3 % in all (Redis's timer work, once a
    # second under --hz 1, lands in one phase or another as the machine's load makes it).
    assert abs(sum(again.values()) / sum(first.values()) - 1) < 0.03, (first, again)
    # 20,000 loop iterations per FINISH of 16 items: tens of thousands of instructions per item.
    assert more["FINISH"] - first["FINISH"] > 20_000, (first, more)
    assert abs(more["ENQUEUE"] / first["ENQUEUE"] - 1) < 0.05, (first, more)


def test_lone_calls_each_find_their_stream_empty(valgrind, tmp_path):
    """--lone: every call alone on an empty stream, as a lone caller's; a script that does more
    only when its stream holds entries is seen in batches, not there."""
    busier = tmp_path / "busier"
    shutil.copytree(REPOSITORY / "rstreamer", busier / "rstreamer", ignore=shutil.ignore_patterns("__pycache__"))
    admission = busier / "rstreamer" / "wire" / "lua" / "include" / "admission.lua"
    probe = "  if length > 0 then\n"
    assert probe in admission.read_text()
    admission.write_text(admission.read_text().replace(probe, probe + "    for i = 1, 20000 do backlog = i end\n"))

    def counts(*options: str) -> list[dict[str, float]]:
        argv = ["instructions", *options, "--output", str(tmp_path), "--tree", str(REPOSITORY), "--tree", str(busier)]
        assert bench.main(argv) == 0
        return json.loads((tmp_path / "bench-instructions.json").read_text())["rows"]

    alone, busier_alone = counts("--lone", "--cycles", "60")
    assert abs(busier_alone["ENQUEUE"] / alone["ENQUEUE"] - 1) < 0.05, (alone, busier_alone)
    assert alone["FINISH"] > 0 and alone["BLPOP"] > 0
    batched, busier_batched = counts("--cycles", "10", "--group", "16", "--groups", "1")
    assert busier_batched["ENQUEUE"] - batched["ENQUEUE"] > 20_000, (batched, busier_batched)
