"""rstreamer bench jobs: targets and table on fake numbers, argument parsing (no timing assertions)."""
from __future__ import annotations

from rstreamer_tools.bench_jobs import Phase, format_result, parse_args, reference_points
from workers.timed import TimedEchoModel


def phases() -> list[Phase]:
    return [Phase("calls", 1000, 1.0, 1000.0, p99_ms=20.0), Phase("job", 1000, 1.02, 980.0),
            Phase("interactive", 0, 4.0, 0.0, 200.0, 40.0, 50.0),
            Phase("job+interactive", 1000, 1.3, 760.0, 200.0, 45.0, 90.0)]


def test_targets_compare_the_job_with_the_calls_and_the_capacity_left():
    args = parse_args(["--batch-ms", "30", "--item-ms", "0.5", "--batch-size", "20"])
    result = reference_points(phases(), args)
    assert result["batch_ms"] == 40.0
    assert round(result["job_vs_calls"], 3) == 0.98
    assert round(result["job_share_of_left"], 3) == 0.95  # 760 of the 800 items/s left
    assert result["interactive_p99_bound_ms"] == 90.0
    assert all(result["reached"].values())
    table = format_result(result)
    assert "job+interactive" in table and "not reached" not in table


def test_quick_shortens_the_run():
    args = parse_args(["--quick"])
    assert args.items == 5000 and args.interactive_seconds == 4.0
    assert parse_args([]).items == 50_000


def test_timed_model_echoes():
    model = TimedEchoModel()
    model.init_model(batch_seconds=0.0, item_seconds=0.0)
    assert model.predict([1, "a"]) == [1, "a"]
