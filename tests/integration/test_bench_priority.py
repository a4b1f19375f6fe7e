"""`rstreamer bench priority` in a tiny configuration: it runs every phase and reports the reference points."""
from __future__ import annotations

import json

import pytest

from rstreamer_tools import bench

pytestmark = pytest.mark.integration


def test_bench_priority_runs_every_phase_and_reports_the_reference_points(redis_url, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("RSTREAMER_REDIS_URL", redis_url)
    argv = ["priority", "--phase-seconds", "1.5", "--batch-size", "4", "--base-ms", "10", "--per-item-ms", "1",
            "--bulk-call", "8", "--output", str(tmp_path)]
    assert bench.main(argv) == 0
    report = json.loads((tmp_path / "bench-priority.json").read_text())
    phases = {phase["name"]: phase for phase in report["phases"]}
    assert list(phases) == ["unloaded", "flood", "saturated", "tenants", "sharing-fifo", "sharing-fair"]
    assert phases["unloaded"]["interactive_calls"] > 0 and phases["unloaded"]["interactive_p99_ms"] > 0
    assert phases["flood"]["cancelled_items"] > 0
    assert phases["flood"]["cancelled_executed"] == 0, "an item cancelled before delivery ran"
    assert set(phases["saturated"]["share"]) == {"urgent", "bulk"}
    assert phases["tenants"]["rate_limited_calls"] > 0
    for name in ("sharing-fifo", "sharing-fair"):
        assert set(phases[name]["share"]) == {"light", "hog"} and phases[name]["interactive_calls"] > 0
    references = [p["reference"] for p in report["reference_points"]]
    assert references[2] == "0 model executions of items cancelled before delivery"
    out = capsys.readouterr().out
    assert "interactive p99 under flood" in out and "with fair sharing" in out and "wrote" in out
