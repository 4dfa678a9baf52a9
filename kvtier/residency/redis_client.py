"""The one way this code base talks to Redis: client factory, key hash tag, per-call deadline.

- :func:`hash_tag`: ``{namespace:model}``, the tag every key of a model carries, so a model's
  keys share one Redis Cluster slot (scripts may then touch all of them).
- :func:`connect`: a client with no retries and short socket timeouts, single node
  (``redis://``, ``rediss://``, ``unix://``) or Redis Cluster (``redis+cluster://host:port``,
  any one node of the cluster; ``rediss+cluster://`` with TLS).
- :func:`bounded`: one call under one deadline; every Redis failure (or the deadline) becomes
  :class:`kvtier.errors.ResidencyUnavailable`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError, ResponseError

from kvtier.errors import ResidencyUnavailable

T = TypeVar("T")

RedisClient = Redis | RedisCluster
"""What :func:`connect` returns: the scripts and commands used here work on both."""

CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


def hash_tag(namespace: str, model_seed: str) -> str:
    """``{namespace:model}`` with braces removed from the parts (a ``}`` would end the tag and
    split a model's keys across slots)."""
    clean = "".join(c for c in f"{namespace}:{model_seed}" if c not in "{}")
    return "{" + clean + "}"


def is_cluster_url(url: str) -> bool:
    return url.split("://", 1)[0] in CLUSTER_SCHEMES


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
    try:
        if deadline_s is None:
            return await fn()
        async with asyncio.timeout(deadline_s):  # no extra task, unlike wait_for
            return await fn()
    except ResponseError as exc:
        raise ResidencyUnavailable(f"redis {what} refused: {exc}") from exc
    except (RedisError, OSError, TimeoutError) as exc:
        limit = "" if deadline_s is None else f" within {deadline_s * 1000:.0f} ms"
        raise ResidencyUnavailable(f"redis {what} failed{limit}: {exc!r}") from exc
