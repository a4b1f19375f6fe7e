"""`rstreamer bench hotpath` in a tiny configuration: every row and the A/B, with per item costs."""
from __future__ import annotations

import json

import pytest

from rstreamer_tools import bench

pytestmark = pytest.mark.integration


def test_bench_hotpath_reports_cpu_and_commands_per_item_and_the_idle_lanes(tmp_path, capsys):
    # 200 lone calls: /proc counts a process's CPU in 10 ms ticks, and 30 calls' worth of the
    # worker's CPU (about 7 ms) could round to none.
    argv = ["hotpath", "--lone-calls", "200", "--callers", "8", "--duration", "0.5", "--rounds", "1",
            "--ab-seconds", "0.5", "--output", str(tmp_path)]
    assert bench.main(argv) == 0
    report = json.loads((tmp_path / "bench-hotpath.json").read_text())
    lone, trip, loaded, floor, tasks, idle = report["rows"]
    answer = report["array_answer"]
    assert answer["dimensions"] == 768 and min(answer["encode_us"], answer["decode_us"], answer["reply_row_us"]) > 0
    assert lone["items"] == 200 and loaded["items"] > 0 and tasks["items"] > 0
    assert tasks["name"] == "8 tasks (asyncio)"
    for row in (lone, loaded, tasks):
        assert row["client_us"] > 0 and row["worker_us"] > 0 and row["redis_us"] > 0
        assert row["switches"] > 0  # a call parks its caller at least once
        # Every item is one XADD, whatever else the path costs; the bench's own INFO is not counted.
        # Under load, the 8 calls in flight when the window opens were enqueued before it (and
        # those in flight when it closes are not counted): as many XADDs may be missing.
        in_flight = 0 if row is lone else 8
        assert row["by_command"]["xadd"] * row["items"] >= row["items"] - in_flight
        assert "info" not in row["by_command"]
    # The round trip floor: the lone calls by hand, seven plain commands each (XREADGROUP, XACK
    # and XDEL per read: one per item here), no script. (The bare prefix's worker is alive
    # meanwhile: its heartbeats add a few commands.)
    assert trip["name"] == "round trip floor" and trip["items"] == 200 and trip["redis_us"] > 0
    for command in ("xadd", "blpop", "rpush", "pexpire"):
        assert 1 <= trip["by_command"][command] < 1.1, trip["by_command"]
    assert trip["by_command"].get("evalsha", 0) < 0.1 and 5 < trip["commands"] < 7.5
    assert 0 < trip["p50_ms"] <= trip["p99_ms"]
    # The thread floor: the same callers answered by a thread, no Redis: CPU and switches, no command.
    assert floor["name"] == "thread floor" and floor["items"] > 0
    assert floor["client_us"] > 0 and floor["switches"] > 0 and floor["by_command"] == {}
    assert [r["name"] for r in report["a_b"]] == ["bare", "lanes idle", "lanes idle + fair"]
    assert all(r["items_per_s"] > 0 for r in report["a_b"])
    assert report["a_b"][0]["against_bare"] == 0.0 and report["a_b"][1]["against_bare"] is not None
    # Fair sharing for callers of no tenant: nothing held (ZADD, PTTL, HINCRBY) and nothing moved
    # (ZPOPMIN). Its total is not compared with the bare prefix's: at 8 callers an ENQUEUE carries
    # one to three calls, and its published levels' GET and held count's ZCARD, with an EXISTS a
    # read, add up to 2 commands an item more in rounds this short.
    fair = report["a_b"][2]["by_command"]
    assert all(fair.get(name, 0) < 0.05 for name in ("zadd", "pttl", "hincrby", "zpopmin")), fair
    # The lone calls again, on the prefix whose lanes are idle: the same commands as the bare
    # prefix's (no probe of the other levels, no second exchange to wait).
    assert idle["name"] == "lone caller, lanes idle" and idle["items"] == 200
    assert idle["by_command"]["xreadgroup"] < 1.1 and "xpending" not in idle["by_command"], idle["by_command"]
    assert idle["by_command"].get("xread", 0) < 0.1 and idle["commands"] < lone["commands"] + 0.5
    # Each reference point the rows decide, judged: the lone caller's three, each process's CPU
    # under load (threads and tasks) and the idle lanes, with fair sharing for a tenant alone too.
    judged = [c["check"] for c in report["reference_checks"]]
    assert judged[:3] == ["lone caller: Redis commands per item", "lone caller: Redis µs per item",
                          "lone caller: p50 ms"]
    assert sum(name.startswith(("8 callers:", "8 tasks (asyncio):")) for name in judged) == 6
    assert judged[3] == "lone caller, lanes idle: Redis commands per item"
    assert judged[-2:] == ["lanes idle: items/s against the bare prefix, %",
                           "lanes idle + fair: items/s against the bare prefix, %"] and len(judged) == 12
    out = capsys.readouterr().out
    assert "commands per item, lone caller" in out and "load average" in out
    assert "compared with the hot path's reference points" in out
