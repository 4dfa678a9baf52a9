"""The reference worker as a holder: device-only blocks are cascaded into host pages for an
offer, and a cancelled offer gives back every page it staged, only after its copy ended."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from kvtier.keys import BlockHash, OffloadKey, offload_key
from kvtier.pages import CopyDirection
from kvtier.worker.holder import DeviceHoldings

from .conftest import RunningWorker
from .pd_helpers import assert_released, connector, workers

PROMPT = "Blocks this holder computed live on its device only. " * 3


def prompt_hashes(w: RunningWorker) -> list[BlockHash]:
    return w.worker.engine.hasher.hash_tokens(w.worker.tokenizer.encode(PROMPT))


def prompt_keys(w: RunningWorker, group: int = 0) -> list[OffloadKey]:
    return [offload_key(h, group) for h in prompt_hashes(w)]


async def warm(w: RunningWorker) -> None:
    resp = await w.client.post(
        "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    )
    assert resp.status_code == 200, resp.text


async def test_device_only_blocks_are_cascaded_for_an_offer() -> None:
    async with workers("sim", "consumer") as (holder,):
        await warm(holder)
        conn = connector(holder)
        keys = prompt_keys(holder)
        assert conn.pool.stats().readable == 0  # nothing in host pages yet
        holdings = DeviceHoldings(conn.tier, conn.pool, conn.kv, conn._copy)
        held = await holdings.pin_leading([*keys, offload_key(BlockHash(b"\0" * 16), 0), keys[0]])
        assert [h.key for h in held] == keys  # the run ends at the unknown block
        assert conn.pool.stats().referenced == len(keys)
        device = conn.kv.pools[0]
        for item, block_hash in zip(held, prompt_hashes(holder), strict=True):
            page = device.lookup(block_hash)
            assert page is not None
            assert bytes(item.page.view()) == bytes(device.page_bytes(page).numpy())
        for item in held:
            item.page.release()
        assert_released(holder)


async def test_a_cancelled_offer_waits_for_its_copy_then_gives_everything_back() -> None:
    async with workers("sim", "consumer") as (holder,):
        await warm(holder)
        conn = connector(holder)
        started = asyncio.Event()
        release = asyncio.Event()
        copies_ended: list[int] = []

        async def slow_copy(
            group: int, direction: CopyDirection, blocks: Sequence[int], pages: Sequence[int]
        ) -> None:
            started.set()
            await release.wait()
            await conn._copy(group, direction, blocks, pages)
            copies_ended.append(group)

        holdings = DeviceHoldings(conn.tier, conn.pool, conn.kv, slow_copy)
        task = asyncio.create_task(holdings.pin_leading(prompt_keys(holder)))
        await started.wait()
        assert conn.pool.stats().writing > 0  # host pages staged for the copy
        task.cancel()
        await asyncio.sleep(0.05)
        assert not task.done()  # it waits for the copy: the pages are still being written
        release.set()
        try:
            await task
        except asyncio.CancelledError:
            pass
        else:
            raise AssertionError("the offer was not cancelled")
        assert copies_ended == [0]
        assert_released(holder)
        assert conn.pool.stats().readable == 0  # a cancelled copy installs nothing
