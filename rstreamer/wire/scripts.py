"""The Lua scripts rstreamer runs: read once from ``lua/*.lua``, registered once per client.

One file per script (``lua/NAME.lua``); its first lines carry the flags (``#!lua flags=allow-oom``)
and a header naming its KEYS and ARGV. Shared Lua lives in ``lua/include/`` and is pulled in by a
line ``--- @include "include/NAME.lua"``, resolved here (as bullmq's script loader does).

Why ``allow-oom`` on the worker's scripts (Redis 7): Redis refuses every command of a MULTI, and
every memory-growing command of a script without the flag, once used memory is over maxmemory. A
worker must still be able to answer, ack and delete then, or the queue that filled Redis could
never drain: deleting answered entries is what frees memory. The overshoot is bounded by what one
call of a script writes (one batch's replies and dead letters, one heartbeat, one consumer group).

Use: ``scripts(client).finish(keys=[...], args=[...])``, with a sync or an asyncio client.
"""
from __future__ import annotations

import re
import weakref
from importlib import resources
from typing import Any, TypedDict

__all__ = ["NAMES", "ScriptArgs", "Scripts", "scripts", "source"]

NAMES = (
    "cancel",
    "enqueue_calls",
    "ensure_group",
    "finish",
    "forget_consumer",
    "heartbeat",
    "job_admit",
    "job_cancel",
    "job_create",
    "job_feed",
    "job_record",
    "queue_depths",
    "read_levels",
    "read_own_pending",
    "read_serving",
    "read_workers",
    "shelf_drop_lease",
    "shelf_state",
    "shelf_take_lease",
)
_INCLUDE = re.compile(r'^--- @include "([\w/]+\.lua)"$', re.M)


def _read(relative: str) -> str:
    return resources.files(__package__).joinpath(f"lua/{relative}").read_text(encoding="utf-8")


def _resolve(text: str, seen: frozenset[str] = frozenset()) -> str:
    """``text`` with each include line replaced by the file it names (an include cycle is an error)."""
    def include(match: re.Match[str]) -> str:
        name = match.group(1)
        if name in seen:
            raise ValueError(f"Lua include cycle through {name}")
        return _resolve(_read(name), seen | {name}).rstrip("\n")

    return _INCLUDE.sub(include, text)


_SOURCES = {name: _resolve(_read(f"{name}.lua")) for name in NAMES}


def source(name: str) -> str:
    """The full text of script ``name`` (includes resolved), as Redis runs it."""
    return _SOURCES[name]


class Scripts:
    """Every script registered on one client (sync or asyncio). Each attribute is redis-py's
    ``Script``/``AsyncScript``: call it with ``keys=`` and ``args=`` (EVALSHA, loaded on first use)."""

    cancel: Any
    enqueue_calls: Any
    ensure_group: Any
    finish: Any
    forget_consumer: Any
    heartbeat: Any
    job_admit: Any
    job_cancel: Any
    job_create: Any
    job_feed: Any
    job_record: Any
    queue_depths: Any
    read_levels: Any
    read_own_pending: Any
    read_serving: Any
    read_workers: Any
    shelf_drop_lease: Any
    shelf_state: Any
    shelf_take_lease: Any

    def __init__(self, client: Any) -> None:
        for name in NAMES:
            setattr(self, name, client.register_script(_SOURCES[name]))


_REGISTERED: weakref.WeakKeyDictionary[Any, Scripts] = weakref.WeakKeyDictionary()


def scripts(client: Any) -> Scripts:
    """The scripts registered on ``client``, once per client (registering only hashes the source)."""
    found = _REGISTERED.get(client)
    if found is None:
        found = _REGISTERED[client] = Scripts(client)
    return found


class ScriptArgs(TypedDict):
    """The keyword arguments of a redis-py Script call."""

    keys: list[str]
    args: list[Any]
