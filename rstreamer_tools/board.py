"""Draw deploy/grafana's dashboard from a real Prometheus, without Grafana.

Each panel's queries (``$prefix`` as ``.*``, ``$__rate_interval`` as given) are run by
Prometheus's ``/api/v1/query_range`` and drawn with matplotlib where the panel's ``gridPos``
puts it. Used by the tests to render the board shown in docs/observability.md from a real run;
Grafana itself (not a Debian or PyPI package) is not needed.
"""
from __future__ import annotations

import json
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

GRID_COLUMNS = 24


def expand(expr: str, rate_interval: str) -> str:
    """A panel query with the dashboard's variables replaced (every prefix)."""
    return expr.replace("$__rate_interval", rate_interval).replace('=~"$prefix"', '=~".*"')


def query_range(prometheus: str, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
    """The ``result`` of one range query."""
    params = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step})
    with urllib.request.urlopen(f"{prometheus}/api/v1/query_range?{params}", timeout=30) as response:
        body = json.load(response)
    if body.get("status") != "success":
        raise RuntimeError(f"query failed: {expr}: {body}")
    return list(body["data"]["result"])


def legend(template: str, labels: dict[str, str]) -> str:
    """Grafana's ``{{label}}`` legend format."""
    for name, value in labels.items():
        template = template.replace("{{" + name + "}}", value)
    return template


def panel_series(board: dict[str, Any], prometheus: str, start: float, end: float, step: float,
                 rate_interval: str) -> list[list[tuple[str, list[float], list[float]]]]:
    """For each panel, its ``(legend, times, values)`` series (NaN points dropped)."""
    drawn = []
    for panel in board["panels"]:
        lines = []
        for target in panel["targets"]:
            for series in query_range(prometheus, expand(target["expr"], rate_interval), start, end, step):
                points = [(float(t), float(v)) for t, v in series["values"] if v not in ("NaN", "+Inf", "-Inf")]
                if points:
                    lines.append((legend(target.get("legendFormat", ""), series["metric"]),
                                  [t - start for t, _ in points], [v for _, v in points]))
        drawn.append(lines)
    return drawn


def render(board: dict[str, Any], series: list[list[tuple[str, list[float], list[float]]]], out: Path) -> None:
    """Draw the panels on a grid like Grafana's and save a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in board["panels"])
    figure = plt.figure(figsize=(16, rows * 0.42), facecolor="#111217")
    grid = figure.add_gridspec(rows, GRID_COLUMNS, hspace=1.4, wspace=2.5, top=0.95, bottom=0.04, left=0.04,
                               right=0.98)
    for panel, lines in zip(board["panels"], series, strict=True):
        pos = panel["gridPos"]
        axes = figure.add_subplot(grid[pos["y"]:pos["y"] + pos["h"] - 1, pos["x"]:pos["x"] + pos["w"]])
        axes.set_facecolor("#181b1f")
        axes.set_title(panel["title"], color="#ccccdc", fontsize=10, loc="left")
        axes.tick_params(colors="#8e8e9a", labelsize=7)
        axes.grid(color="#2c3038", linewidth=0.5)
        for name, times, values in lines:
            axes.plot(times, values, linewidth=1.2, label=name)
        if lines:
            axes.legend(fontsize=6.5, loc="upper left", facecolor="#181b1f", labelcolor="#ccccdc", framealpha=0.7)
        axes.set_xlabel("seconds", color="#8e8e9a", fontsize=7)
    figure.suptitle(f"{board['title']} (deploy/grafana, drawn from Prometheus)", color="#ccccdc")
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=90, facecolor=figure.get_facecolor())
    plt.close(figure)
