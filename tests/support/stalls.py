"""A fault in a client's pops: the streamers' own commands, but a BLPOP waits out its timeout and
finds nothing (the worker's answers stay in their reply keys). Tests put these in place of the
coalescers' ``direct_command`` / ``async_direct_command`` with monkeypatch."""
from __future__ import annotations

import asyncio
import time
from typing import Any

from rstreamer.broker.direct import async_direct_command, direct_command
from rstreamer.wire.keys import Keys


def stalled_blpop(client: Any, *command: Any) -> Any:
    """The threads' coalescer's commands, but a BLPOP finds nothing."""
    if command[0] != "BLPOP":
        return direct_command(client, *command)
    time.sleep(command[-1])
    return None


async def async_stalled_blpop(client: Any, *command: Any) -> Any:
    """The asyncio coalescer's commands, but a BLPOP finds nothing."""
    if command[0] != "BLPOP":
        return await async_direct_command(client, *command)
    await asyncio.sleep(command[-1])
    return None


def reply_keys(prefix: str) -> str:
    """The pattern of every reply key of ``prefix``."""
    return Keys(prefix).reply("x:1").rsplit(":", 2)[0] + ":*"
