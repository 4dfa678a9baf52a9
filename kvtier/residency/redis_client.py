"""The one way this code base talks to Redis: client factory, key hash tag, per-call deadline.

- :func:`hash_tag`: ``{namespace:model}``, the tag every key of a model carries, so a model's
  keys share one Redis Cluster slot (scripts may then touch all of them).
- :func:`connect`: a client with no retries and short socket timeouts, single node
  (``redis://``, ``rediss://``, ``unix://``) or Redis Cluster (``redis+cluster://host:port``,
  any one node of the cluster; ``rediss+cluster://`` with TLS).
- :func:`bounded`: one call under one deadline; every Redis failure (or the deadline) becomes
  :class:`kvtier.errors.ResidencyUnavailable`, and a cancel of the caller that the client ate
  is raised again (:class:`kvtier.tasks.CallerCancel`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError, RedisError, ResponseError

from kvtier.errors import ResidencyUnavailable
from kvtier.tasks import CallerCancel

T = TypeVar("T")

RedisClient = Redis | RedisCluster
"""What :func:`connect` returns: the scripts and commands used here work on both."""

CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


def hash_tag(namespace: str, model_seed: str) -> str:
    """``{namespace:model}`` with braces removed from the parts (a ``}`` would end the tag and
    split a model's keys across slots)."""
    clean = "".join(c for c in f"{namespace}:{model_seed}" if c not in "{}")
    return "{" + clean + "}"


def connect(
    url: str, *, socket_timeout_s: float, connect_timeout_s: float, max_connections: int = 64
) -> RedisClient:
    """A client for ``url`` that never retries (a failed call fails at once; the caller's
    breaker decides what happens next)."""
    scheme, _, rest = url.partition("://")
    if scheme in CLUSTER_SCHEMES:
        return RedisCluster.from_url(
            f"{CLUSTER_SCHEMES[scheme]}://{rest}",
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=connect_timeout_s,
            retry=Retry(NoBackoff(), 0),
            max_connections=max_connections,
        )
    return Redis.from_url(
        url,
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=connect_timeout_s,
        retry=Retry(NoBackoff(), 0),
        max_connections=max_connections,
        health_check_interval=0,
    )


async def bounded(what: str, deadline_s: float | None, fn: Callable[[], Awaitable[T]]) -> T:
    """``fn()`` under ``deadline_s`` (None: the caller bounds it), Redis failures translated.

    The deadline stops the wait, not a script already running inside Redis: that is why the
    scripts' work per call is capped (see :mod:`kvtier.residency.redis_index`).
    """
    cancel = CallerCancel()
    try:
        if deadline_s is None:
            result = await fn()
        else:
            async with asyncio.timeout(deadline_s):  # no extra task, unlike wait_for
                result = await fn()
    except ResponseError as exc:
        cancel.check(what, exc)
        raise ResidencyUnavailable(f"redis {what} refused: {exc}") from exc
    except (RedisError, OSError, TimeoutError) as exc:
        cancel.check(what, exc)
        limit = "" if deadline_s is None else f" within {deadline_s * 1000:.0f} ms"
        raise ResidencyUnavailable(f"redis {what} failed{limit}: {exc!r}") from exc
    cancel.check(what)
    return result


def _arg(value: bytes | str | int) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, int):
        return b"%d" % value
    return value.encode()


def _packed(parts: list[bytes]) -> bytes:
    """One command in RESP; ``b"".join`` of ``%``-formatted parts is a C loop, where the
    client's own packer spends microseconds per argument (a match names ~1,000 keys)."""
    return b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%b\r\n" % (len(p), p) for p in parts)


def packed_hmget(key: bytes, fields: Sequence[bytes], width: int) -> bytes:
    """``HMGET key fields...`` in RESP for fields of ``width`` bytes each (at least one): one
    C-level join, however many fields."""
    head = b"*%d\r\n$5\r\nHMGET\r\n$%d\r\n%b\r\n$%d\r\n" % (len(fields) + 2, len(key), key, width)
    return head + (b"\r\n$%d\r\n" % width).join(fields) + b"\r\n"


def packed_command(*parts: bytes) -> bytes:
    return _packed(list(parts))


async def run_packed(
    client: Redis, data: bytes, replies: int, *, scripts: Sequence[AsyncScript] = ()
) -> list[Any]:
    """Send commands packed by :func:`packed_command`, :func:`packed_hmget` and
    :func:`packed_script_call` in one write on a single-node client and read their ``replies``
    replies (an error reply raises). ``scripts``: those the data calls by SHA; when Redis lost
    one (NOSCRIPT: refused before it ran) they are loaded and the data sent again, so pass
    scripts only when every command sent is a read."""
    pool = client.connection_pool
    conn = await pool.get_connection()  # type: ignore[no-untyped-call]
    try:
        for attempt in range(2):
            await conn.send_packed_command(data, check_health=False)
            results: list[Any] = []
            error: ResponseError | None = None
            for _ in range(replies):
                try:
                    results.append(await conn.read_response())
                except ResponseError as exc:
                    error = error or exc
            if error is None:
                return results
            if not isinstance(error, NoScriptError) or not scripts or attempt == 1:
                raise error
            await _load_scripts(conn, scripts)
        raise AssertionError("unreachable")
    except ResponseError:
        raise
    except BaseException:
        await conn.disconnect()  # a reply may be left unread: never reuse this connection
        raise
    finally:
        await pool.release(conn)


async def _load_scripts(conn: Any, scripts: Sequence[AsyncScript]) -> None:
    for script in {id(s): s for s in scripts}.values():
        source = script.script
        body = source.encode() if isinstance(source, str) else bytes(source)
        await conn.send_packed_command(_packed([b"SCRIPT", b"LOAD", body]), check_health=False)
        await conn.read_response()


ScriptCall = tuple[AsyncScript, Sequence[bytes], Sequence[bytes | str | int]]
"""A script, its KEYS and its ARGV."""


def packed_script_call(call: ScriptCall) -> bytes:
    """``EVALSHA`` of one script call in RESP."""
    script, keys, args = call
    return _packed([b"EVALSHA", script.sha.encode(), b"%d" % len(keys), *keys, *map(_arg, args)])


async def run_scripts(client: Redis, calls: Sequence[ScriptCall]) -> list[Any]:
    """Run script calls in order in one round trip on a single-node client, packing them
    here; a script Redis lost (NOSCRIPT refuses before running anything) is loaded and the
    whole batch sent again. Error replies raise like the client's own calls."""
    pool = client.connection_pool
    conn = await pool.get_connection()  # type: ignore[no-untyped-call]
    try:
        data = b"".join(map(packed_script_call, calls))
        for attempt in range(2):
            await conn.send_packed_command(data, check_health=False)
            results: list[Any] = []
            lost: ResponseError | None = None
            for _ in calls:
                try:
                    results.append(await conn.read_response())
                except NoScriptError as exc:
                    lost = exc
                except ResponseError as exc:
                    results.append(exc)
            if lost is None:
                for r in results:
                    if isinstance(r, ResponseError):
                        raise r
                return results
            if attempt == 1:
                raise lost
            await _load_scripts(conn, [s for s, _, _ in calls])
        raise AssertionError("unreachable")
    except (ResponseError, NoScriptError):
        raise
    except BaseException:
        await conn.disconnect()  # a reply may be left unread: never reuse this connection
        raise
    finally:
        await pool.release(conn)
