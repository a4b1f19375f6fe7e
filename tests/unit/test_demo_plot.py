"""The demo's parts without its processes: the plot (latency, throughput, the mean batch size
against the batch-size limit, the load phases), what it says of its batches, its arguments."""
from __future__ import annotations

import matplotlib.pyplot as plt

from rstreamer_tools import demo, demo_generate
from rstreamer_tools.demo_load import Phase, Sample, figure, mean_batch, throughput_series, why_this_batch_size


def samples() -> list[Sample]:
    # 40 answers, 0.1 s apart, each taking 50 ms; one failed request.
    answered = [Sample("s", n * 0.1, 0.05, 200, [1.0]) for n in range(40)]
    return answered + [Sample("s", 0.3, 0.05, 500, None)]


def test_throughput_counts_the_answers_of_each_half_second():
    rates = throughput_series(samples())
    assert sum(rate * 0.5 for _, rate in rates) == 40, "every answered request counted once, failures not"
    assert rates[0] == (0.0, 10.0)  # 5 answers in the first 0.5 s


def test_the_plot_shows_latency_throughput_and_the_batch_size_limit():
    drawing = figure(samples(), [(1.0, 12.0), (2.0, 30.5)], batch_size=32)
    try:
        latency, throughput, batches = drawing.axes
        assert throughput.get_ylabel() == "answered requests/s" and throughput.lines
        limit = [line for line in batches.lines if line.get_label().startswith("batch size limit")]
        assert limit and list(limit[0].get_ydata()) == [32, 32]
        assert batches.get_ylim() == (0, 32 * 1.15)
        assert latency.get_yscale() == "log", "milliseconds for one client, seconds under a deep queue"
        assert throughput.get_ylim()[0] == 0 and batches.get_ylim()[0] == 0
    finally:
        plt.close(drawing)


def test_the_plot_marks_each_phase_with_its_clients():
    phases = [Phase(1, "HTTP", 0.0, 2.0), Phase(256, "client", 2.0, 4.0)]
    drawing = figure(samples(), [(1.0, 1.0), (3.0, 32.0)], 32, phases)
    try:
        labels = [text.get_text() for text in drawing.axes[0].texts]
        assert labels == ["1 HTTP\nclients", "256 callers\n(Python client)"]
        assert all(len(axis.patches) == 2 for axis in drawing.axes), "each phase shaded on every panel"
    finally:
        plt.close(drawing)


def test_mean_batch_of_a_phase_comes_from_the_heartbeat_totals_around_it():
    points = [(0.0, 10, 10), (1.0, 20, 20), (2.0, 30, 20 + 10 * 16), (3.0, 32, 20 + 10 * 16 + 64)]
    assert mean_batch(points, 0.5, 1.0) == 1.0  # 10 batches of 1 since the point before the phase
    assert mean_batch(points, 1.5, 3.0) == (10 * 16 + 64) / 12


def test_the_explanation_names_what_bounds_the_batches():
    text = " ".join(why_this_batch_size(2, 32, 0.02).split())
    assert "N clients keep at most N items in Redis, shared by 2 workers" in text
    assert "about N/2" in text and "2 x 32 = 64" in text and "--max-latency 0.02 s" in text


def test_load_phases_and_callers_are_arguments():
    args = demo.parse_args([])
    assert (args.clients, args.callers, args.seconds) == (demo.LOAD_PHASES, demo.CALLERS, 4.0)
    assert demo.parse_args(["--clients", "2,64", "--callers", "0"]).clients == [2, 64]
    assert demo.parse_args(["--generate"]).clients is None  # the generate part's own default (questions or streams)


def test_the_generate_part_serves_any_model_reference():
    assert demo.parse_args(["--generate"]).generate_model is None  # the real chat model
    assert demo_generate.worker_command(demo_generate.MODEL, 8)[-1] == "workers.llm:ChatModel"
    assert demo_generate.MODEL not in demo_generate.TOY_MODELS
    assert demo_generate.TOY in demo_generate.TOY_MODELS, "the toy decoder keeps its note"
    args = demo.parse_args(["--generate", "--generate-model", "mymodels.llm:Chat"])
    assert demo_generate.worker_command(args.generate_model, 8)[-1] == "mymodels.llm:Chat"
    assert "mymodels.llm:Chat" not in demo_generate.TOY_MODELS, "a real model gets no toy note"
