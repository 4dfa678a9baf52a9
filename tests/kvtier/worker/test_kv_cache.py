"""The engine's prefix hits follow the tiering manager's window rule; wrong KV changes output."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.keys import BlockHasher, offload_key
from kvtier.offload.scan import RequestChunks, scan_request
from kvtier.offload.types import LookupResult
from kvtier.offload.window import AttentionKind, ChunkLayout, GroupSpec
from kvtier.worker.build import build_engine
from kvtier.worker.kv_cache import KVCache
from kvtier.worker.kv_layout import KVGroupSpec
from kvtier.worker.sampling import SamplingParams

from .conftest import small_settings

BS = 4
WINDOW = 10


@settings(max_examples=150, deadline=None)
@given(
    num_tokens=st.integers(1, 60),
    present=st.lists(st.tuples(st.booleans(), st.booleans()), min_size=15, max_size=15),
)
def test_hit_blocks_equals_the_managers_scan(
    num_tokens: int, present: list[tuple[bool, bool]]
) -> None:
    """I3: the engine's device prefix hit and the tiering manager's load scan are one rule."""
    groups = (
        KVGroupSpec(0, (0,), None, (1,), torch.uint8),
        KVGroupSpec(1, (1,), WINDOW, (1,), torch.uint8),
    )
    kv = KVCache(groups, BS, 4, torch.device("cpu"))
    hashes = BlockHasher("rule", BS).hash_tokens(list(range(num_tokens)))
    layout = ChunkLayout(BS, 1, (GroupSpec(0), GroupSpec(1, AttentionKind.SLIDING_WINDOW, WINDOW)))
    chunks = RequestChunks.from_block_hashes(layout, hashes, num_tokens)
    keys = {offload_key(h, g): present[b][g] for b, h in enumerate(hashes) for g in (0, 1)}

    def lookup(key: bytes) -> LookupResult:
        return LookupResult.HIT if keys[key] else LookupResult.MISS  # type: ignore[index]

    scan = scan_request(chunks, lookup, layout)
    cap = kv.max_hit_blocks(num_tokens, BS)
    assert kv.hit_blocks(hashes, cap, has=lambda g, b: present[b][g]) == scan.hit_chunks


@pytest.mark.parametrize("model", ["tiny", "sim"])
async def test_a_corrupted_cached_page_changes_the_output(model: str) -> None:
    """Equivalence tests prove KV arrived intact only because wrong KV shows in the text."""
    engine = build_engine(small_settings(model=model))
    await engine.start()
    try:
        prompt = list(b"The answer depends on every page that attention reads. " * 2)
        params = SamplingParams(max_tokens=12, temperature=0)
        cold = [t for o in await engine.generate("cold", prompt, params) for t in o.token_ids]
        last_block = (len(prompt) - 1) // 16 - 1
        for pool in engine.kv.pools:
            page = pool.lookup(engine.hasher.hash_tokens(prompt)[last_block])
            assert page is not None
            view = pool.page_bytes(page)
            view[: view.numel() // 2] = 7  # garbage in half the page
        warm = await engine.generate("warm", prompt, params)
        assert warm[-1].num_cached_tokens > 0
        assert [t for o in warm for t in o.token_ids] != cold
    finally:
        await engine.close()
