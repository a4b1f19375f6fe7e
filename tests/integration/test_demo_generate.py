"""`rstreamer demo --generate` end to end, small: it streams over SSE and through the client,
checks its answers and leaves nothing running."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import redis

from rstreamer.broker.embedded import EmbeddedRedis
from support import procs


@pytest.mark.timeout(120)
def test_demo_generate_streams_checks_and_cleans_up(tmp_path: Path) -> None:
    with EmbeddedRedis() as server:
        env = procs.test_env()
        env["RSTREAMER_REDIS_URL"] = server.url
        result = subprocess.run(
            [sys.executable, "-c", "import sys; from rstreamer.cli import main; sys.exit(main(sys.argv[1:]))",
             "demo", "--generate", "--clients", "4", "--output", str(tmp_path)],
            cwd=procs.ROOT, env=env, capture_output=True, text=True, timeout=110,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        # The toy decoder's text is gibberish: the demo says so before it shows any.
        note = result.stdout.index("The decoder is a toy: a small Transformer with random weights")
        assert note < result.stdout.index("POST /generate") and "gibberish by design" in result.stdout
        assert "64 chunks as Server-Sent Events" in result.stdout
        assert "joined: yes; every stream complete: yes" in result.stdout
        client = redis.Redis.from_url(server.url)
        try:
            assert len(client.client_list()) == 1, client.client_list()
            assert not list(client.scan_iter(match="rstreamer:*")), "the demo's keys must be removed"
        finally:
            client.close()
