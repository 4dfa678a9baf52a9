"""Retired node slots of the Redis index: scrubbed from every block, then handed back.

A forgotten or cleared node's slot is retired at once (matches ignore it) but its bits and
prediction entries stay in the block values until a sweep scrubs them; only then is the slot
free for another node. The sweep scans the residency and prediction hashes one bounded step per
script call (``sweep.lua``, about ``chunk`` fields each), so Redis serves other clients between
steps, then frees the slots (``free.lua``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from kvtier.residency.redis_client import RedisClient
from kvtier.residency.redis_layout import ModelKeys, script_source
from kvtier.residency.redis_settings import RedisIndexSettings

Call = Callable[[str, float | None, Callable[[], Awaitable[Any]]], Awaitable[Any]]
"""How the index runs one Redis call (its deadline, its error translation)."""


class RetiredSlots:
    def __init__(
        self, client: RedisClient, keys: ModelKeys, settings: RedisIndexSettings, call: Call
    ) -> None:
        self._redis = client
        self._keys = keys
        self._settings = settings
        self._call = call
        self._sweep = client.register_script(script_source("sweep.lua"))
        self._free = client.register_script(script_source("free.lua"))

    async def sweep(self, chunk: int) -> list[int]:
        """Scrub the slots retired now from every block and free them; returns them."""
        k = self._keys
        members: set[bytes] = await self._call(
            "sweep", self._settings.deadline_s, lambda: self._redis.smembers(k.retired)
        )
        slots = sorted(int(m) for m in members)
        if not slots:
            return []
        for key, kind in ((k.res, b"r"), (k.pred, b"p")):
            cursor: bytes | int = 0
            while True:
                cursor = await self._call(
                    "sweep",
                    self._settings.apply_deadline_s,
                    lambda: self._sweep(keys=[key], args=[kind, cursor, chunk, *slots]),  # noqa: B023
                )
                if int(cursor) == 0:
                    break
        await self._call(
            "sweep",
            self._settings.deadline_s,
            lambda: self._free(keys=[k.retired, k.free, k.epoch], args=slots),
        )
        return slots
