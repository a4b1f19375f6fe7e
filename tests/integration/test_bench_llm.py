"""`rstreamer bench llm` end to end on a few short chats (real workers, the real chat model); the
table and target lines on fake numbers. No timing assertions: speed is what the benchmark prints."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rstreamer_tools.bench_llm import Run, check_targets, format_table, workload
from support import procs


def test_workload_is_greedy_chats_log_uniform_between_the_bounds() -> None:
    items = workload(2000, 8, 256)
    lengths = sorted(item["max_tokens"] for item in items)
    assert lengths[0] == 8 and lengths[-1] == 256
    assert 32 <= lengths[len(lengths) // 2] <= 58  # the geometric middle of 8..256 is 45
    assert all(item["temperature"] == 0 and item["messages"][0]["role"] == "user" for item in items)
    assert workload(10, 8, 256) == workload(10, 8, 256)


def test_table_and_targets_on_fake_numbers() -> None:
    runs = [Run("request-level", 10, tokens=500, tokens_per_s=10.0, ttft_p50_ms=20_000.0, ttft_p99_ms=40_000.0),
            Run("continuous", 10, tokens=500, tokens_per_s=40.0, ttft_p50_ms=1_000.0, ttft_p99_ms=3_000.0,
                inter_token_p99_ms=900.0),
            Run("in-process", 10, tokens=500, tokens_per_s=42.0, ttft_p50_ms=800.0)]
    table = format_table(runs)
    assert "all at once" in table and "20,000" in table
    lines = check_targets(runs)
    assert lines[0].startswith("reached") and "x4.00" in lines[0]
    assert lines[1].startswith("reached") and "x20.00" in lines[1]
    assert lines[2].startswith("reached") and "x0.95" in lines[2]
    assert lines[3] == "Redis share of the continuous run's time: 5%"
    runs[1].tokens_per_s = 20.0
    assert [line[:11] for line in check_targets(runs)[:3]] == ["not reached", "reached    ", "not reached"]


@pytest.mark.timeout(600)
def test_bench_llm_runs_the_three_ways(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", "import sys; from rstreamer.cli import main; sys.exit(main(sys.argv[1:]))",
         "bench", "llm", "--chats", "4", "--callers", "2", "--shortest", "2", "--longest", "6",
         "--output", str(tmp_path)],
        cwd=procs.ROOT, env=procs.test_env(), capture_output=True, text=True, timeout=580)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "Redis share of the continuous run's time" in result.stdout and "load average" in result.stdout
    document = json.loads((tmp_path / "bench-llm.json").read_text())
    runs = {run["policy"]: run for run in document["runs"]}
    assert set(runs) == {"request-level", "continuous", "in-process"}
    assert all(run["failed"] == 0 and run["chats"] == 4 and run["tokens"] >= 4 for run in runs.values())
    # Greedy, the same chats: every way makes the same number of tokens.
    assert len({run["tokens"] for run in runs.values()}) == 1


def test_a_gpu_the_machine_does_not_have_is_refused_before_anything_starts() -> None:
    import torch

    from rstreamer_tools.bench_llm import main

    missing = torch.cuda.device_count()
    with pytest.raises(SystemExit, match=f"--gpu {missing}, but torch sees {missing} CUDA device"):
        main(["--gpu", str(missing), "--chats", "1"])
