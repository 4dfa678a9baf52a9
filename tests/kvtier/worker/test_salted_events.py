"""KV events of requests with a ``cache_salt``: block 0 names its salt (vLLM's ``extra_keys``
form), so a router indexes the chain under the salt the request carried, never as unsalted."""

from __future__ import annotations

from kvtier.events import BlockStored
from kvtier.residency.memory import MemoryIndex
from kvtier.residency.types import NodeId

from .conftest import running_worker, small_settings

PROMPT = "A tenant's prompt, salted by the proxy. " * 3  # 120 tokens: 7 full blocks


async def test_salted_blocks_are_indexed_under_their_salt() -> None:
    async with running_worker(small_settings(model="sim")) as w:
        for salt in ("tenant-a", None):
            body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "cache_salt": salt}
            resp = await w.client.post("/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
        batch = w.worker.events.take_batch()
        assert batch is not None
        roots = [
            e.extra_keys for e in batch.events
            if isinstance(e, BlockStored) and e.parent_block_hash is None
        ]  # fmt: skip
        assert sorted(roots, key=repr) == sorted([None, (("tenant-a",), *[None] * 6)], key=repr)
        hasher = w.worker.engine.hasher
        index = MemoryIndex(hasher)
        await index.apply(NodeId("w"), batch)
        ids = list(PROMPT.encode())
        for salt in ("tenant-a", None):
            match = (await index.match(hasher.hash_tokens(ids, cache_salt=salt)))[NodeId("w")]
            assert match.gpu == 7, salt
        assert await index.match(hasher.hash_tokens(ids, cache_salt="tenant-b")) == {}
