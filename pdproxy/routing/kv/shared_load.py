"""Load shared by proxy replicas through Redis: atomic counters per replica and node.

Layout (all keys under one hash tag, so Redis Cluster keeps them in one slot)::

    {<prefix>:<model>}:load       hash  "<replica>|if|<node>" → requests in flight
                                        "<replica>|pt|<node>" → prefill tokens queued
    {<prefix>:<model>}:replicas   zset  replica → heartbeat expiry (server clock, ms)

Each replica changes only its own fields, with ``HINCRBY`` (atomic). A read sums the fields of
live replicas in one script call, so a replica that died stops counting once its heartbeat
expires, and a replica that starts late sees everyone's load at once. The heartbeat also rewrites
the replica's own fields from its local view, which heals any change lost while Redis was away.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from kvtier.residency.redis_client import RedisClient, ScriptCall, hash_tag
from pdproxy.routing.kv.state import LoadDelta, NodeLoad

# One HMGET per live replica (not per node): a decision over a thousand candidates stays a few
# commands inside Redis.
_READ = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local live = redis.call('ZRANGEBYSCORE', KEYS[1], now, '+inf')
local out = {}
for i = 1, 2 * #ARGV do out[i] = 0 end
for _, r in ipairs(live) do
  local fields = {}
  for i, node in ipairs(ARGV) do
    fields[2 * i - 1] = r .. '|if|' .. node
    fields[2 * i] = r .. '|pt|' .. node
  end
  local v = redis.call('HMGET', KEYS[2], unpack(fields))
  for i = 1, #fields do out[i] = out[i] + (tonumber(v[i]) or 0) end
end
return out
"""

# ARGV: replica, ttl_ms, then field/value pairs of the replica's own load.
_HEARTBEAT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local me = ARGV[1]
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), me)
local dead = {}
for _, r in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. now)) do dead[r] = true end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. now)
for _, f in ipairs(redis.call('HKEYS', KEYS[2])) do
  local owner = string.match(f, '^(.-)|')
  if owner == me or dead[owner] then redis.call('HDEL', KEYS[2], f) end
end
for i = 3, #ARGV, 2 do redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1]) end
return #ARGV
"""

_LEAVE = """
redis.call('ZREM', KEYS[1], ARGV[1])
for _, f in ipairs(redis.call('HKEYS', KEYS[2])) do
  if string.match(f, '^(.-)|') == ARGV[1] then redis.call('HDEL', KEYS[2], f) end
end
return 1
"""


class RedisLoad:
    """One replica's handle on the shared load counters."""

    def __init__(
        self,
        client: RedisClient,
        *,
        prefix: str,
        model_seed: str,
        replica_ttl_s: float,
        replica: str | None = None,
    ) -> None:
        tag = hash_tag(prefix, model_seed)
        self._client = client
        self._keys = (f"{tag}:replicas".encode(), f"{tag}:load".encode())
        self._ttl_ms = max(int(replica_ttl_s * 1000), 1)
        self.replica = replica or uuid.uuid4().hex[:16]
        self._read = client.register_script(_READ)
        self._heartbeat = client.register_script(_HEARTBEAT)
        self._leave = client.register_script(_LEAVE)

    async def read(self, nodes: Sequence[str]) -> dict[str, NodeLoad]:
        if not nodes:
            return {}
        return self.parse_read(nodes, await self._read(keys=self._keys, args=list(nodes)))

    def read_call(self, nodes: Sequence[str]) -> ScriptCall:
        """:meth:`read` as a script call (read-only) for a caller that sends it with others
        in one round trip; :meth:`parse_read` turns its reply into loads."""
        return (self._read, self._keys, list(nodes))

    @staticmethod
    def parse_read(nodes: Sequence[str], raw: list[Any]) -> dict[str, NodeLoad]:
        return {
            node: NodeLoad(max(int(raw[2 * i]), 0), max(int(raw[2 * i + 1]), 0))
            for i, node in enumerate(nodes)
        }

    async def add(self, deltas: Sequence[LoadDelta]) -> None:
        if not deltas:
            return
        pipe = self._client.pipeline(transaction=False)
        for d in deltas:
            if d.in_flight:
                pipe.hincrby(self._keys[1], f"{self.replica}|if|{d.node}", d.in_flight)
            if d.queued_tokens:
                pipe.hincrby(self._keys[1], f"{self.replica}|pt|{d.node}", d.queued_tokens)
        await pipe.execute()

    async def heartbeat(self, own: Mapping[str, NodeLoad]) -> None:
        """Mark this replica live and make its fields equal ``own`` (its local view)."""
        args: list[str | int] = [self.replica, self._ttl_ms]
        for node, load in own.items():
            if load.in_flight:
                args += [f"{self.replica}|if|{node}", load.in_flight]
            if load.queued_tokens:
                args += [f"{self.replica}|pt|{node}", load.queued_tokens]
        await self._heartbeat(keys=self._keys, args=args)

    async def leave(self) -> None:
        """Withdraw this replica's load (on clean shutdown)."""
        await self._leave(keys=self._keys, args=[self.replica])
