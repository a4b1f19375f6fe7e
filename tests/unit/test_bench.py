"""rstreamer bench: table, JSON, reference checks and plot on fake numbers; load generators on a thread streamer.

No timing assertions: speed is what the benchmark prints, never what a test checks.
"""
from __future__ import annotations

import json
from argparse import Namespace

import pytest

from rstreamer.local import ThreadedStreamer
from rstreamer_tools import bench
from rstreamer_tools.bench import MODELS, Result, Target
from workers.echo import echo_predict


def fake_results() -> list[Result]:
    rows = [
        Result("noop", "direct", 1e8, mean_batch=64.0, lone_p50_ms=0.001, lone_p99_ms=0.002),
        Result("noop", "redis-1", 20_000, lone_p50_ms=0.6, lone_p99_ms=1.2, load_p50_ms=3.0, load_p99_ms=9.0,
               mean_batch=30.0, calls=100_000),
        Result("noop", "ss-redis-1", 4_000, lone_p50_ms=101.0, lone_p99_ms=102.0, load_p50_ms=15.0),
        Result("noop", "redis-2", 21_000, ceiling="direct-x2", burst_callers=512, burst_calls=9000, burst_failed=0),
        Result("transformer", "direct", 400, mean_batch=64.0, lone_p50_ms=4.4, lone_p99_ms=5.0),
        Result("transformer", "direct-x2", 790, ceiling="direct-x2"),
        Result("transformer", "threaded", 396, lone_p50_ms=4.6, load_p50_ms=160.0, mean_batch=40.0),
        Result("transformer", "redis-1", 385, lone_p50_ms=5.1, load_p50_ms=170.0, mean_batch=33.0),
        Result("transformer", "redis-2", 700, ceiling="direct-x2", lone_p50_ms=5.2, mean_batch=20.0),
    ]
    bench.set_ratios(rows)
    return rows


def test_ratios_are_against_the_ceiling_of_the_same_model():
    rows = {(r.model, r.transport): r for r in fake_results()}
    assert rows["transformer", "redis-1"].ratio == pytest.approx(385 / 400)
    assert rows["transformer", "redis-2"].ratio == pytest.approx(700 / 790)
    assert rows["noop", "redis-2"].ratio is None  # no direct-x2 row for the no-op model


def test_table_has_every_row_and_the_burst_line():
    table = bench.format_table(fake_results())
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["model", "transport", "items/s"]
    assert any("redis-1" in line and "20,000" in line and "<0.01 of direct" in line for line in lines)
    assert any("0.96 of direct" in line for line in lines)
    assert "512 concurrent callers, noop through redis-2: 9000 calls, 0 failed" in table
    assert all("None" not in line for line in lines)


def test_comparison_and_reference_checks():
    rows = fake_results()
    compared = bench.comparison(rows)
    assert compared == [{"model": "noop", "transport": "redis-1", "throughput_x": 5.0,
                         "lone_p50_x": pytest.approx(101 / 0.6)}]
    assert "throughput x5.00" in bench.format_comparison(compared)
    checks = {c["check"]: c for c in bench.reference_checks(rows)}
    assert checks["noop redis-1 throughput / service-streamer's"]["ok"]
    assert checks["noop redis-1 lone p50 ms"]["ok"]
    assert checks["transformer redis-1 lone p50 ms (reference: model time + 1)"]["reference"] == pytest.approx(5.4)
    assert not checks["transformer redis-2 / direct-x2"]["ok"]  # 0.886 < 0.90
    assert checks["transformer threaded / direct"]["value"] == pytest.approx(0.99)
    text = bench.format_reference_checks(list(checks.values()))
    assert "not reached  transformer redis-2 / direct-x2: 0.886 (reference: at least 0.9)" in text
    assert "reached      noop redis-1 lone p50 ms: 0.6 (reference: below 2)" in text
    # Words for users: nothing about targets, misses or issues they never saw.
    assert not any(word in text.lower() for word in ("miss", "target", "issue", "goal"))


def test_outputs_are_json_and_png(tmp_path):
    args = Namespace(output=str(tmp_path / "out"), quick=True)
    output = bench.write_outputs(fake_results(), args, bench.machine_info())
    document = json.loads((output / "bench.json").read_text())
    assert {"machine", "options", "results", "comparison", "reference_checks"} <= set(document)
    assert document["results"][1]["items_per_s"] == 20_000
    assert (output / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_percentile_is_nearest_rank():
    assert bench.percentile([], 0.5) is None
    assert bench.percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert bench.percentile(list(range(1, 101)), 0.99) == 99


def test_load_generators_on_a_thread_streamer():
    model = MODELS["noop"]
    with ThreadedStreamer(echo_predict, 8, 0.01) as streamer:
        target = Target(streamer.predict, lambda sent: (streamer.stats.batches, streamer.stats.items))
        lone = bench.run_sequential(target, model, seconds=0.2, max_calls=20)
        load = bench.run_concurrent(target, model, callers=4, seconds=0.2)
    assert lone.completed == 20 and lone.failed == 0
    assert load.completed > 0 and load.failed == 0
    assert target.sent >= lone.completed + load.completed


def test_wrong_answers_count_as_failures():
    target = Target(lambda batch, timeout: ["something else" for _ in batch])
    phase = bench.run_sequential(target, MODELS["noop"], seconds=1.0, max_calls=3)
    assert (phase.completed, phase.failed, phase.errors) == (0, 3, {"wrong answer": 3})


def test_options(monkeypatch):
    args = bench.parse_args(["--quick", "--models", "noop", "--transports", "threaded,redis"])
    assert (args.models, args.transports, args.duration) == (["noop"], ["threaded", "redis"], 1.0)
    with pytest.raises(SystemExit):
        bench.parse_args(["--models", "bert"])


def test_transformer_model_is_deterministic_and_offline():
    pytest.importorskip("torch")
    from workers.transformer import TransformerModel, example_item

    first, second = TransformerModel(), TransformerModel()
    first.init_model()
    second.init_model(threads=1)
    batch = [example_item(n) for n in range(3)]
    outputs = first.predict(batch)
    assert len(outputs) == 3 and outputs[0].shape == (256,)
    assert all((a == b).all() for a, b in zip(outputs, second.predict(batch), strict=True))


def test_rate_counts_whole_batch_cycles_not_where_the_window_cuts_them():
    # Batches of 64 answered every 0.17 s; a 5 s window sees 29 bursts whatever its phase.
    ends = [0.05 + 0.17 * k + 0.0001 * i for k in range(29) for i in range(64)]
    phase = bench.Phase(completed=len(ends), seconds=5.0, ends=ends)
    assert phase.rate == pytest.approx(64 / 0.17, rel=0.01)
    assert bench.Phase(completed=10, seconds=5.0).rate == 2.0
    steady = [0.0001 * i for i in range(50_000)]  # no bursts: 10,000 items/s
    assert bench.Phase(completed=len(steady), seconds=5.0, ends=steady).rate == pytest.approx(10_000, rel=0.01)


def test_the_plot_uses_linear_axes_from_zero_and_sets_the_outlier_aside():
    import matplotlib.pyplot as plt

    drawing = bench.figure(fake_results())
    try:
        for axis in drawing.axes:
            assert axis.get_xscale() == "linear" and axis.get_xlim()[0] == 0, axis.get_title()
        noop_throughput = drawing.axes[0]
        assert [label.get_text() for label in noop_throughput.get_yticklabels()] == ["redis-1", "ss-redis-1", "redis-2"]
        assert "direct (100,000,000) not drawn" in noop_throughput.get_title()
        transformer_bars = [patch.get_width() for patch in drawing.axes[2].patches]
        assert transformer_bars[:2] == [400, 790], "every transformer row is drawn to scale"
    finally:
        plt.close(drawing)
