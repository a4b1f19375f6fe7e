"""Commands written straight on a pooled connection: the hot path's without redis-py's command
machinery.

A command through ``redis.Redis.execute_command`` passes its retry wrapper, event dispatch,
metrics recorder and response callbacks, which cost a streamer's I/O thread more than writing the
command and reading its reply (an ENQUEUE of 16 calls: 216 against 178 us of client CPU on a
2-vCPU VM; issue 26). Only a plain ``redis.Redis`` has one server to write to; any other client
(a Redis Cluster routes each command by its key) runs the command its usual way. Errors are
redis-py's own, as from ``execute_command`` on a client that never retries.
"""
from __future__ import annotations

from typing import Any

import redis
from hiredis import pack_command  # redis[hiredis] is a dependency
from redis.commands.core import Script

from .connection import RedisClient


def direct_command(client: RedisClient, *args: Any) -> Any:
    """The reply of one command, written on a connection of ``client``'s pool (a plain client)."""
    if not isinstance(client, redis.Redis):
        return client.execute_command(*args)
    pool = client.connection_pool
    connection: Any = pool.get_connection()  # redis-py leaves most of Connection unannotated
    try:
        # Packed in one C call: redis-py's serializer first copies every argument through a
        # generator (an ENQUEUE of 16 calls: 1 us per call of its 11 in Python; issue 26).
        connection.send_packed_command((pack_command(args),))
        return connection.read_response()
    except redis.ResponseError:
        raise  # the error is the whole reply: the connection is fit for the next command
    except BaseException:
        connection.disconnect()  # half a conversation: the next user must not read the rest
        raise
    finally:
        pool.release(connection)


def run_script(client: RedisClient, script: Script, keys: list[Any], args: list[Any]) -> Any:
    """``script(keys=keys, args=args)``, its EVALSHA written directly; a Redis that lost its scripts
    (a restart, SCRIPT FLUSH) ran nothing, and gets the script loaded and run again."""
    try:
        return direct_command(client, "EVALSHA", script.sha, len(keys), *keys, *args)
    except redis.exceptions.NoScriptError:
        return script(keys=keys, args=args)  # redis-py's Script loads it and runs it
