"""The demo's plot: latency, throughput, and the mean batch size against the batch-size limit."""
from __future__ import annotations

import matplotlib.pyplot as plt

from rstreamer_tools.demo import Sample, figure, throughput_series


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
        assert all(axis.get_ylim()[0] == 0 for axis in drawing.axes)
    finally:
        plt.close(drawing)
