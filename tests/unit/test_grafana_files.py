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

import yaml
from prometheus_client import CollectorRegistry

from rstreamer.ops import metrics
from rstreamer.worker.records import WorkerStats
from support.system import require_debian_tool

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
    level = {"level": 0, "queue_length": 0, "oldest_wait_s": 0.0, "drain_s": 0.0}
    registry.register(metrics.QueueCollector(lambda: [{"prefix": "p", "queue_length": 0, "pending": 0,
                                                       "dead_letters": 0, "oldest_wait_s": 0.0, "workers": [],
                                                       "levels": [level], "drain": {"items_per_s": 1.0}}],
                                             drain_target=30.0))
    return {sample.name for family in registry.collect() for sample in family.samples} | {"up"}


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
    assert {rule["alert"] for rule in rules} == {
        "RStreamerNoLiveWorker", "RStreamerQueueMetricsMissing", "RStreamerScrapeTargetDown",
        "RStreamerOldestItemWaiting", "RStreamerDrainTimeAboveTarget", "RStreamerDeadLettersGrowing",
        "RStreamerErrorRatioHigh"}
    for rule in rules:
        assert rule["labels"]["severity"] in ("warning", "critical") and rule["annotations"]["summary"]


def test_every_alert_has_a_promtool_test_and_the_critical_ones_one_of_their_source_gone():
    rules = [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]
    tests = yaml.safe_load((GRAFANA / "rstreamer-alerts-test.yml").read_text())["tests"]
    fired = {case["alertname"] for test in tests for case in test["alert_rule_test"] if case["exp_alerts"]}
    assert {rule["alert"] for rule in rules} <= fired, "every alert is tested firing"
    critical = [rule for rule in rules if rule["labels"]["severity"] == "critical"]
    # The source of the critical alerts is the exporter: a critical rule fires on its absence.
    assert any("absent(" in rule["expr"] and "rstreamer_queue_" in rule["expr"] for rule in critical)
    gone = [test for test in tests if any("stale" in series["values"] for series in test["input_series"])]
    assert any(case["alertname"] == "RStreamerQueueMetricsMissing" and case["exp_alerts"]
               for test in gone for case in test["alert_rule_test"])


def test_promtool_checks_and_unit_tests_the_rules():
    promtool = require_debian_tool("promtool", "prometheus")
    for args in (["check", "rules", RULES.name], ["test", "rules", "rstreamer-alerts-test.yml"]):
        result = subprocess.run([promtool, *args], cwd=GRAFANA, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr
