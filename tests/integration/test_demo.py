"""`rstreamer demo` end to end, small: it must answer correctly, write its plot and leave nothing running."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import redis

from rstreamer.broker.embedded import EmbeddedRedis
from support import procs


# The one test that imports torch in a worker, starts gunicorn and stops both through the CLI:
# on a busy shared machine that alone can approach the suite's 60 s default.
@pytest.mark.timeout(120)
def test_demo_runs_checks_plots_and_cleans_up(tmp_path):
    with EmbeddedRedis() as server:
        env = procs.test_env()
        env["RSTREAMER_REDIS_URL"] = server.url
        result = subprocess.run(
            [str(Path(sys.executable).parent / "rstreamer"), "demo", "--requests", "60", "--clients", "6",
             "--workers", "1", "--web-workers", "1", "--output", str(tmp_path)],
            cwd=procs.ROOT, env=env, capture_output=True, text=True, timeout=110,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        assert "errors           0" in result.stdout
        assert "answers checked  20/20 paraphrases closer" in result.stdout
        assert (tmp_path / "rstreamer-demo.png").stat().st_size > 10_000
        client = redis.Redis.from_url(server.url)
        try:
            # Workers and web processes each held connections: only ours may be left.
            assert len(client.client_list()) == 1, client.client_list()
            assert not list(client.scan_iter(match="rstreamer:*")), "the demo's keys must be removed"
        finally:
            client.close()
