"""The OpenAI server's model directory refreshes a prefix's gate, and with it the gate's copy of the
published levels, which that prefix's streamer sends with its ENQUEUEs (issue 26): the copy must
come from the directory's read, since the streamer's own read is rarely due there."""
from __future__ import annotations

from typing import Any

from rstreamer.client.gate import Heartbeats
from rstreamer.wire.keys import Keys
from rstreamer.wire.published import LevelsCopy
from webapp.openai.config import OpenAIConfig
from webapp.openai.models import ModelDirectory


def test_the_directory_s_read_fills_the_gate_s_copy_of_the_levels():
    directory = ModelDirectory(OpenAIConfig(), dead_after=15.0, grace=30.0)
    seen: list[Any] = []

    def read(keys: Keys, levels: LevelsCopy) -> Heartbeats:
        seen.append((keys.prefix, levels))
        levels.update(b'{"weights": [8, 1]}')  # what read_serving does with the levels key
        return 1_000_000, {"w1": {"seen_ms": 1_000_000}}

    assert directory.resolve("chat", read) == "chat"
    gate = directory.gate("chat")
    assert seen == [("chat", gate.levels)]
    assert gate.levels.fresh() == b'{"weights": [8, 1]}'
