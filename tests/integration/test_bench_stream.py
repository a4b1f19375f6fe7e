"""`rstreamer bench stream --tiny` end to end (real workers, a SIGKILL mid-run); the table and
target lines on fake numbers. No timing assertions: speed is what the benchmark prints."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rstreamer_tools.bench_stream import Run, check_targets, format_table, workload
from support import procs


def test_workload_is_log_uniform_between_the_bounds() -> None:
    items = workload(2000, 4, 256)
    lengths = sorted(item["max_new_tokens"] for item in items)
    assert lengths[0] == 4 and lengths[-1] == 256
    assert 14 <= lengths[len(lengths) // 2] <= 40  # the geometric middle of 4..256 is 32
    assert workload(10, 4, 256) == workload(10, 4, 256)


def test_table_and_targets_on_fake_numbers() -> None:
    runs = [Run("request-level", 1, requests=10, tokens_per_s=100.0, ttfc_p50_ms=5000.0, ttfc_p99_ms=9000.0),
            Run("continuous", 1, requests=10, tokens_per_s=400.0, ttfc_p50_ms=100.0, ttfc_p99_ms=300.0,
                per_chunk_p50_ms=20.0),
            Run("continuous, SIGKILL", 2, requests=10, killed=42, intact=True, reclaimed=3)]
    table = format_table(runs)
    assert "x4.0" in table and "x50.0" in table and "all at once" in table
    lines = check_targets(runs)
    assert lines[0].startswith("reached") and "tokens/s x4.0" in lines[0]
    assert lines[1].startswith("reached") and "x50.0" in lines[1]
    assert lines[2].startswith("reached") and "pid 42" in lines[2]
    runs[1].tokens_per_s = 200.0
    assert check_targets(runs)[0].startswith("not reached")


@pytest.mark.timeout(240)
def test_bench_stream_tiny_runs_and_every_stream_survives_the_sigkill(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", "import sys; from rstreamer.cli import main; sys.exit(main(sys.argv[1:]))",
         "bench", "stream", "--tiny", "--output", str(tmp_path)],
        cwd=procs.ROOT, env=procs.test_env(), capture_output=True, text=True, timeout=230)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "every stream complete, in order, no chunk repeated or missing: True" in result.stdout
    document = json.loads((tmp_path / "bench-stream.json").read_text())
    runs = {run["policy"]: run for run in document["runs"]}
    assert set(runs) == {"request-level", "continuous", "continuous, SIGKILL"}
    assert all(run["failed"] == 0 and run["requests"] == 16 for run in runs.values())
    assert runs["continuous, SIGKILL"]["intact"] is True and runs["continuous, SIGKILL"]["killed"]
