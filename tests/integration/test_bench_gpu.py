"""`rstreamer bench gpu` without a GPU: its steps run on the CPU (placement, a model timed through
Redis by one worker and by two), and those whose figures mean GPU memory say they were skipped."""
from __future__ import annotations

import json

import pytest

from rstreamer_tools import bench

pytestmark = pytest.mark.integration


# Seven processes import torch (two workers and their supervisor, two of Streamer, the sleeper's
# worker and supervisor): in a fresh virtual environment, with nothing in the disk cache yet,
# that alone took over a minute on a 2-vCPU VM.
@pytest.mark.timeout(300)
def test_bench_gpu_runs_its_steps_on_the_cpu_and_skips_the_gpu_memory_ones(tmp_path, capsys):
    pytest.importorskip("torch")  # the check models are torch models (make test installs torch)
    argv = ["gpu", "--steps", "placement,oom,shelf,sleeper", "--seconds", "1", "--processes", "1",
            "--threads", "8", "--batch-size", "4", "--workers", "1,2", "--output", str(tmp_path)]
    assert bench.main(argv) == 0
    report = json.loads((tmp_path / "bench-gpu.json").read_text())
    assert report["gpu_bytes"] == 0
    placement = report["placement"]
    # Two worker processes of --gpus 0 --workers-per-gpu 2 and two of Streamer(cuda_devices=[0]),
    # each told GPU 0 before its model was built.
    assert placement["ok"] and placement["status_gpus"] == [0, 0]
    for where in placement["workers"] + placement["streamer"]:
        assert (where["gpu_id"], where["visible"], where["device"]) == (0, "0", "cpu")
    assert len({w["pid"] for w in placement["workers"]} | {w["pid"] for w in placement["streamer"]}) == 4
    assert report["oom"]["skipped"] == "no GPU" and report["shelf"]["skipped"] == "no GPU"
    sleeper = report["sleeper"]
    assert sleeper["ok"] and sleeper["direct_items_s"] > 0 and sleeper["direct_batch_ms"] >= 4.8
    # Served by one worker, then by two on the same GPU, side by side against the same direct call.
    assert [row["workers"] for row in sleeper["through_redis"]] == [1, 2]
    for row in sleeper["through_redis"]:
        assert row["redis_items_s"] > 0 and 0 < row["ratio"]
        # The model's own time per batch is its sleep (4.8 ms); the worker's time between two batches is measured.
        assert row["worker"]["run_p50_ms"] >= 4.8 and row["worker"]["gap_p50_ms"] > 0
        assert row["worker"]["mean_batch"] >= 1
    out = capsys.readouterr().out
    assert '"placement"' in out and '"sleeper"' in out
