"""deploy/grafana: the dashboard JSON and the alert rules query only metrics the code exports.

The metric names come from the code's own collectors (a worker's, a client's and the queue
gauges), so renaming a metric without updating the board or the rules fails here. The rules are
also checked by promtool (``check rules``, and ``test rules`` against deploy/grafana's unit
tests) when Debian's prometheus package is installed or can be.
"""
from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry

from rstreamer.ops import metrics
from rstreamer.worker.records import WorkerStats
from support.system import debian_tool

GRAFANA = Path(__file__).resolve().parents[2] / "deploy" / "grafana"
BOARD = GRAFANA / "rstreamer-dashboard.json"
RULES = GRAFANA / "rstreamer-alerts.yml"
METRIC = re.compile(r"\brstreamer_[a-z_]+\b")


def exported_names() -> set[str]:
    registry = CollectorRegistry()
    worker = metrics.WorkerMetrics("p", registry)
    worker.track(WorkerStats())
    with metrics.ClientMetrics(registry).track("p"):  # one call makes the labelled client series exist
        pass
    registry.register(metrics.QueueCollector(lambda: [{"prefix": "p", "queue_length": 0, "pending": 0,
                                                       "dead_letters": 0, "oldest_wait_s": 0.0, "workers": []}]))
    return {sample.name for family in registry.collect() for sample in family.samples}


def board_queries() -> list[str]:
    board = json.loads(BOARD.read_text())
    return [target["expr"] for panel in board["panels"] for target in panel["targets"]]


def rule_queries() -> list[str]:
    return [rule["expr"] for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def test_every_metric_the_board_and_the_rules_query_is_exported():
    names = exported_names()
    queried = {name for expr in board_queries() + rule_queries() for name in METRIC.findall(expr)}
    assert queried and not queried - names, f"not exported by the code: {sorted(queried - names)}"


def test_the_board_covers_what_operators_ask_for():
    board = json.loads(BOARD.read_text())
    titles = " ".join(panel["title"].lower() for panel in board["panels"])
    for topic in ("throughput", "queue wait", "batch size", "fill", "workers", "dead letters", "errors"):
        assert topic in titles
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids)) and all(panel["targets"] for panel in board["panels"])
    assert {v["name"] for v in board["templating"]["list"]} == {"datasource", "prefix"}


def test_every_rule_has_a_severity_and_a_summary():
    rules = [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]
    assert {rule["alert"] for rule in rules} == {"RStreamerNoLiveWorker", "RStreamerOldestItemWaiting",
                                                 "RStreamerDeadLettersGrowing", "RStreamerErrorRatioHigh"}
    for rule in rules:
        assert rule["labels"]["severity"] in ("warning", "critical") and rule["annotations"]["summary"]


def test_promtool_checks_and_unit_tests_the_rules():
    promtool, why = debian_tool("promtool", "prometheus")
    if promtool is None:
        pytest.skip(why)
    for args in (["check", "rules", RULES.name], ["test", "rules", "rstreamer-alerts-test.yml"]):
        result = subprocess.run([promtool, *args], cwd=GRAFANA, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr
