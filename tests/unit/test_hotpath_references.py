"""rstreamer bench hotpath: the report's reference points on fake numbers (the bench itself runs in
I:test_bench_hotpath.py). No timing assertions: speed is what the bench prints."""
from __future__ import annotations

from typing import Any

import pytest

from rstreamer_tools import bench
from rstreamer_tools.bench_hotpath import format_report, lone_to_floor, reference_checks


def row(name: str, client: float, worker: float, redis: float, commands: float, p50: float | None) -> dict[str, Any]:
    return {"name": name, "items": 1000, "seconds": 1.0, "items_per_s": 1000.0, "client_us": client,
            "worker_us": worker, "redis_us": redis, "commands": commands, "p50_ms": p50, "p99_ms": p50,
            "switches": 1.0, "by_command": {"xadd": 1.0}}


def document(lanes_idle: float = 9_600.0) -> dict[str, Any]:
    rows = [row("lone caller", 240.0, 170.0, 135.0, 10.02, 0.47),
            row("round trip floor", 110.0, 150.0, 87.0, 7.01, 0.25),
            row("64 callers", 61.0, 20.0, 13.0, 1.63, 4.2),
            row("thread floor", 19.0, 0.0, 0.0, 0.0, 0.0),
            row("64 tasks (asyncio)", 25.8, 13.2, 8.0, 1.35, 1.8)]
    a_b = [{**row("bare", 60.0, 20.0, 13.0, 1.6, 4.0), "items_per_s": 10_000.0},
           {**row("lanes idle", 60.0, 20.0, 13.0, 2.2, 4.0), "items_per_s": lanes_idle},
           {**row("lanes idle + fair", 60.0, 24.0, 30.0, 14.7, 5.0), "items_per_s": 8_000.0}]
    return {"rows": rows, "a_b": a_b, "options": {"callers": 64, "rounds": 3},
            "machine": {"cpus": 2, "load_before": [0.5], "load_after": [1.5]}}


def test_every_reference_point_of_the_hot_path_is_judged():
    checks = {c["check"]: c for c in reference_checks(document())}
    # The lone caller's commands to a tenth: the heartbeats' 0.02 do not make 10 commands a miss...
    assert checks["lone caller: Redis commands per item"] == {
        "check": "lone caller: Redis commands per item", "value": 10.0, "reference": 10, "ok": True,
        "better": "at most"}
    assert not checks["lone caller: Redis µs per item"]["ok"]
    assert checks["lone caller: p50 ms"]["ok"]
    # ...under load, each process's CPU against its own limit, for the threads and the asyncio tasks.
    assert [c["ok"] for name, c in checks.items() if name.startswith("64 callers:")] == [False, False, False]
    assert [c["ok"] for name, c in checks.items() if name.startswith("64 tasks (asyncio):")] == [True, True, True]
    assert checks["64 tasks (asyncio): Redis µs per item"]["reference"] == 8.0  # at most: 8.0 itself reaches it
    assert checks["lanes idle: items/s against the bare prefix, %"]["value"] == pytest.approx(-4.0)
    assert checks["lanes idle: items/s against the bare prefix, %"]["ok"]
    # Fair sharing for a tenant alone is judged as an idle lane: 8,000 against 10,000 is -20 %.
    assert checks["lanes idle + fair: items/s against the bare prefix, %"]["value"] == pytest.approx(-20.0)
    assert not checks["lanes idle + fair: items/s against the bare prefix, %"]["ok"]
    assert len(checks) == 11


def test_a_tenth_more_commands_or_idle_lanes_six_percent_slower_is_not_reached():
    slower = document(lanes_idle=9_400.0)
    slower["rows"][0]["commands"] = 10.06
    checks = {c["check"]: c for c in reference_checks(slower)}
    assert not checks["lone caller: Redis commands per item"]["ok"]
    assert not checks["lanes idle: items/s against the bare prefix, %"]["ok"]


def test_without_the_a_b_the_idle_lanes_are_not_judged():
    checks = reference_checks({**document(), "a_b": []})
    assert not any(c["check"].startswith("lanes idle") for c in checks)


def test_the_report_ends_with_the_verdicts_in_words_for_users():
    doc = document()
    doc["reference_checks"] = reference_checks(doc)
    text = format_report(doc)
    assert "compared with the hot path's reference points of docs/performance.md" in text
    assert "reached      64 tasks (asyncio): Redis µs per item: 8 (reference: at most 8)" in text
    assert "not reached  lone caller: Redis µs per item: 135 (reference: at most 50)" in text
    assert "reached      lone caller: p50 ms: 0.47 (reference: below 0.5)" in text
    verdicts = text[text.index("compared with"):]
    assert not any(word in verdicts.lower() for word in ("miss", "target", "issue", "goal"))


def test_at_most_includes_the_reference_and_below_does_not():
    assert bench.reference_check("x", 8.0, 8.0, "at most")["ok"]
    assert not bench.reference_check("x", 8.0, 8.0, "lower")["ok"]
    assert bench.reference_check("x", 8.0, 8.0, "higher")["ok"]
    with pytest.raises(KeyError):
        bench.reference_check("x", 1.0, 1.0, "sideways")


def test_the_lone_callers_redis_is_read_against_the_floor_of_the_same_run():
    doc = document()
    assert lone_to_floor(doc) == pytest.approx((135.0, 87.0, 135.0 / 87.0))
    doc["reference_checks"] = reference_checks(doc)
    assert "lone caller: Redis µs per item 135.0, 1.55 times the round trip floor's 87.0" in format_report(doc)


def test_without_a_floor_there_is_no_ratio():
    doc = document()
    doc["rows"] = [r for r in doc["rows"] if r["name"] != "round trip floor"]
    assert lone_to_floor(doc) is None
    doc["reference_checks"] = reference_checks(doc)
    assert "times the round trip floor" not in format_report(doc)
    doc["rows"] = document()["rows"]
    doc["rows"][1]["redis_us"] = 0.0  # a floor that cost Redis nothing measurable: nothing to divide by
    assert lone_to_floor(doc) is None


def test_the_lone_calls_on_idle_lanes_are_judged_by_the_lone_callers_commands():
    doc = document()
    doc["rows"].append(row("lone caller, lanes idle", 240.0, 170.0, 135.0, 10.04, 0.47))
    checks = {c["check"]: c for c in reference_checks(doc)}
    assert checks["lone caller, lanes idle: Redis commands per item"]["ok"]
    doc["rows"][-1]["commands"] = 22.01  # the other levels probed at each read, and a second wait
    checks = {c["check"]: c for c in reference_checks(doc)}
    assert not checks["lone caller, lanes idle: Redis commands per item"]["ok"]


def test_the_idle_lanes_are_judged_by_the_median_of_the_rounds_ratios_when_the_run_has_it():
    # Two rounds in the slow regime of the threads' client, one in the fast: the medians of
    # items/s compare a slow round with a fast one (-20 %), each round's own ratio does not.
    doc = document(lanes_idle=8_000.0)
    doc["a_b"][1]["against_bare"] = -1.5
    checks = {c["check"]: c for c in reference_checks(doc)}
    assert checks["lanes idle: items/s against the bare prefix, %"]["value"] == -1.5
    doc["reference_checks"] = reference_checks(doc)
    assert "  lanes idle            8,000 items/s   -1.5%" in format_report(doc)
    del doc["a_b"][1]["against_bare"]  # a document of an earlier run: the ratio of the medians
    assert {c["check"]: c for c in reference_checks(doc)}[
        "lanes idle: items/s against the bare prefix, %"]["value"] == pytest.approx(-20.0)


def test_the_report_gives_what_an_array_answer_costs_the_codec_when_the_run_measured_it():
    answer = {"dimensions": 768, "encode_us": 1.92, "decode_us": 4.62, "reply_row_us": 5.28}
    measured = {**document(), "array_answer": answer}
    measured["reference_checks"] = reference_checks(measured)
    assert ("an answer of 768 float32: encoded in 1.92 µs and its reply row in 5.28 µs (the worker), decoded in "
            "4.62 µs (the client)") in format_report(measured)
    earlier = {**document()}
    earlier["reference_checks"] = reference_checks(earlier)
    assert "float32" not in format_report(earlier)  # a document written before the figure existed
