"""Commands written straight on a pooled connection: the hot path's without redis-py's command
machinery.

A command through ``redis.Redis.execute_command`` passes its retry wrapper, event dispatch,
metrics recorder and response callbacks, which cost a streamer's I/O thread more than writing the
command and reading its reply (an ENQUEUE of 16 calls: 216 against 178 us of client CPU on a
2-vCPU VM; issue 26). Only a plain ``redis.Redis`` has one server to write to; any other client
(a Redis Cluster routes each command by its key) runs the command its usual way. Errors are
redis-py's own, as from ``execute_command`` on a client that never retries. A worker writes its
batch's FINISH and its next read together the same way, or, after a full batch, writes the
FINISH alone and reads its reply later (:func:`send`; rstreamer.worker.carry). The asyncio
streamer's ENQUEUE and BLPOP go the same way on a plain ``redis.asyncio.Redis``
(:func:`async_direct_command`): there redis-py's serializer alone took a quarter of the client's
CPU per item.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import redis
import redis.asyncio
from hiredis import pack_command  # redis[hiredis] is a dependency
from redis.commands.core import AsyncScript, Script

from .connection import RedisClient

if TYPE_CHECKING:
    from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster


def direct_command(client: RedisClient, *args: Any) -> Any:
    """The reply of one command, written on a connection of ``client``'s pool (a plain client)."""
    if not isinstance(client, redis.Redis):
        return client.execute_command(*args)
    reply = exchange(client, [args])[0]
    if isinstance(reply, redis.ResponseError):
        raise reply
    return reply


def exchange(client: redis.Redis, commands: Sequence[Sequence[Any]],
             first: Callable[[Any], None] | None = None) -> list[Any]:
    """``commands`` written together on one connection of ``client``'s pool, and their replies in
    order; a reply Redis answered with an error is that error as an exception object, so that the
    replies after it are still read (and the connection stays fit for the next user). Redis runs
    a client's commands in order: a command after a blocked read runs the moment the read returns.
    ``first``: called with the first reply as soon as it is read, before the others (which may
    wait on a blocked read): an exception it raises ends the exchange."""
    return send(client, commands).replies(first)


def send(client: redis.Redis, commands: Sequence[Sequence[Any]]) -> Sent:
    """``commands`` written together on one connection of ``client``'s pool, their replies left
    to read later (:meth:`Sent.replies`): Redis runs them meanwhile. The connection is the
    caller's until it reads them or abandons them (:meth:`Sent.abandon`)."""
    pool = client.connection_pool
    connection: Any = pool.get_connection()  # redis-py leaves most of Connection unannotated
    sent = Sent(pool, connection, len(commands))
    try:
        connection.send_packed_command((_packed(commands),))
    except BaseException:
        sent.abandon()
        raise
    return sent


def _packed(commands: Sequence[Sequence[Any]]) -> bytes:
    # Packed in one C call each: redis-py's serializer first copies every argument through a
    # generator (an ENQUEUE of 16 calls: 1 us per call of its 11 in Python; issue 26).
    return b"".join(pack_command(tuple(args)) for args in commands)


class KeptConnection:
    """One connection of a plain client's pool, kept by its one user between exchanges (a
    worker's reads and the FINISH they carry: rstreamer.worker.carry).

    Taking a connection from redis-py's pool and giving it back costs 6.5 us of CPU each time in
    redis-py 8.1 (its connection metrics, an event, the fork check twice, a poll): a sixth of a
    worker's Python for a lone caller, which exchanges once a call (py-spy; issue 26). What the
    checkout is for is kept: before each exchange, a connection with something to read before
    it wrote anything (the end of a connection that a restarted Redis closed) is closed, and the
    write opens a new one; one whose exchange failed half-way is closed at once. The pool counts
    it in use; closing the client closes it. For one thread of one process: not shared, not
    kept across a fork.
    """

    def __init__(self, client: redis.Redis) -> None:
        self._pool = client.connection_pool
        self._connection: Any = None  # redis-py leaves most of Connection unannotated

    def exchange(self, commands: Sequence[Sequence[Any]], first: Callable[[Any], None] | None = None) -> list[Any]:
        """As :func:`exchange`, on the kept connection."""
        connection = self._fit()
        try:
            connection.send_packed_command((_packed(commands),))
            return _replies(connection, len(commands), first)
        except BaseException:
            with contextlib.suppress(Exception):  # the error that ended the conversation is the one raised
                connection.disconnect()  # half a conversation: the next exchange starts afresh
            raise

    def _fit(self) -> Any:
        if self._connection is None:
            self._connection = self._pool.get_connection()  # checked by the pool
            return self._connection
        connection = self._connection
        try:
            # As the pool checks it: something to read, or the end Redis wrote (an error here).
            # can_read connects a connection that is closed.
            stale = connection.can_read()
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            stale = True
        if stale:
            connection.disconnect()  # the write connects it again
        return connection


class Sent:
    """Commands written on a pooled connection whose replies are not read yet (:func:`send`)."""

    def __init__(self, pool: Any, connection: Any, count: int) -> None:
        self._pool, self._connection, self._count = pool, connection, count

    def replies(self, first: Callable[[Any], None] | None = None) -> list[Any]:
        """Their replies, in order, as :func:`exchange` gives them (``first`` as there); the
        connection goes back to the pool."""
        try:
            return _replies(self._connection, self._count, first)
        except BaseException:
            self.abandon()  # half a conversation: the next user must not read the rest
            raise
        finally:
            self._release()

    def abandon(self) -> None:
        """Give the connection back closed, the replies unread (no later user may read the rest)."""
        if self._connection is not None:
            with contextlib.suppress(Exception):  # the error that ended the conversation is the one raised
                self._connection.disconnect()
        self._release()

    def _release(self) -> None:
        # Once: a blocking pool would otherwise queue the same connection twice.
        connection, self._connection = self._connection, None
        if connection is not None:
            self._pool.release(connection)


def _replies(connection: Any, count: int, first: Callable[[Any], None] | None) -> list[Any]:
    if first is None or not count:  # every call of the clients' hot path: one comprehension
        return [_reply(connection) for _ in range(count)]
    replies = [_reply(connection)]
    first(replies[0])
    replies += [_reply(connection) for _ in range(count - 1)]
    return replies


def _reply(connection: Any) -> Any:
    try:
        return connection.read_response()
    except redis.ResponseError as exc:
        return exc


def run_script(client: RedisClient, script: Script, keys: list[Any], args: list[Any]) -> Any:
    """``script(keys=keys, args=args)``, its EVALSHA written directly; a Redis that lost its scripts
    (a restart, SCRIPT FLUSH) ran nothing, and gets the script loaded and run again."""
    try:
        return direct_command(client, "EVALSHA", script.sha, len(keys), *keys, *args)
    except redis.exceptions.NoScriptError:
        return script(keys=keys, args=args)  # redis-py's Script loads it and runs it


async def async_direct_command(client: redis.asyncio.Redis | AsyncRedisCluster, *args: Any) -> Any:
    """The reply of one command, written on a connection of ``client``'s pool (a plain
    ``redis.asyncio.Redis`` of a pool; any other client runs it its usual way). Errors are
    redis-py's own, as from ``execute_command`` on a client that never retries; redis-py's own
    command metrics and events do not see it (as with :func:`direct_command`)."""
    if not isinstance(client, redis.asyncio.Redis) or client.single_connection_client:
        return await client.execute_command(*args)
    pool: Any = client.connection_pool  # redis-py leaves most of it unannotated
    connection: Any = await pool.get_connection()
    try:
        await connection.send_packed_command(pack_command(args))
        return await connection.read_response()
    except redis.ResponseError:
        raise  # Redis answered (the connection is fit for the next user)
    except BaseException:
        # Half a conversation (a cancelled wait included): the next user must not read the rest.
        # The error that ended it is the one raised, whatever closing the connection raises.
        with contextlib.suppress(Exception):
            await connection.disconnect(nowait=True)
        raise
    finally:
        await pool.release(connection)


async def async_run_script(client: redis.asyncio.Redis | AsyncRedisCluster, script: AsyncScript,
                           keys: list[Any], args: list[Any]) -> Any:
    """:func:`run_script` for an asyncio client."""
    try:
        return await async_direct_command(client, "EVALSHA", script.sha, len(keys), *keys, *args)
    except redis.exceptions.NoScriptError:
        return await script(keys=keys, args=args)
