"""A Redis connection of its own for a command every request costs: the XADD that submits it
and the reader's XREAD of token outputs (both on its path to the first token), and the write of
its lifecycle hash.

redis-py's pooled command path (the blocking pool's condition and timeout, retry wrapper,
response callback lookup, observability hooks) costs the gateway about twice the CPU of the
round trip itself, on both sides of the worker's work. Here a command is packed, sent and its
reply read on one connection, with the same checks the pool makes before handing a connection
out (connected, nothing unread) and the same timeouts (the pool's socket timeouts). Any error,
or a cancellation mid-command, drops the connection, so no reply is ever left unread; the next
command reconnects. Commands on one connection run one at a time."""

from __future__ import annotations

import asyncio
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.typing import EncodableT


class DedicatedConnection:
    def __init__(self, redis: Redis) -> None:
        self._conn: AbstractConnection = redis.connection_pool.make_connection()
        self._lock = asyncio.Lock()

    @property
    def busy(self) -> bool:
        """A command is in flight (another one would wait for it)."""
        return self._lock.locked()

    async def execute(self, *args: EncodableT) -> Any:
        """The raw reply (RESP2 or RESP3, as the URL asks) to one command; RedisError as
        redis-py raises it."""
        async with self._lock:
            conn = await self._ready()
            try:
                await conn.send_packed_command(conn.pack_command(*args), check_health=False)
                return await conn.read_response()
            except ResponseError:
                raise  # an error reply: the connection is in step
            except BaseException:
                await conn.disconnect(nowait=True)
                raise

    async def execute_many(self, *commands: tuple[EncodableT, ...]) -> list[Any]:
        """Several commands in one write, their replies in order (as a pipeline without a
        transaction); the first error reply is raised once every reply was read."""
        async with self._lock:
            conn = await self._ready()
            try:
                await conn.send_packed_command(conn.pack_commands(commands), check_health=False)
                replies: list[Any] = []
                for _ in commands:
                    try:
                        replies.append(await conn.read_response())
                    except ResponseError as exc:
                        replies.append(exc)
            except BaseException:
                await conn.disconnect(nowait=True)
                raise
        for reply in replies:
            if isinstance(reply, ResponseError):
                raise reply
        return replies

    async def _ready(self) -> AbstractConnection:
        """Connected, with nothing unread (else the server closed it: reconnect once), as the
        pool checks a connection before lending it."""
        conn = self._conn
        await conn.connect()
        try:
            if await conn.can_read():
                raise ConnectionError("connection has unread data")
        except (ConnectionError, RedisTimeoutError, OSError):
            await conn.disconnect()
            await conn.connect()
            if await conn.can_read():
                raise ConnectionError("connection not ready") from None
        return conn

    async def close(self) -> None:
        await self._conn.disconnect()
