"""Page memory and copy jobs: exact round trips, batching paths, submit/poll/wait, pool backing."""

from __future__ import annotations

import pytest
import torch

from kvtier.errors import PageCopyError, PoolExhausted
from kvtier.keys import BlockHash, OffloadKey, offload_key
from kvtier.offload import HostPagePool, LookupResult
from kvtier.pages import CopyDirection, DevicePages, HostPages, PageCopier, default_device

D2H, H2D = CopyDirection.DEVICE_TO_HOST, CopyDirection.HOST_TO_DEVICE


def key(i: int) -> OffloadKey:
    return offload_key(BlockHash(i.to_bytes(16, "big")), 0)


def filled_device(num_blocks: int, device: torch.device, seed: int = 0) -> DevicePages:
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn((num_blocks, 2, 4, 8), generator=gen).to(torch.float16).to(device)
    return DevicePages(kv)


def round_trip(device: torch.device, *, scattered: bool, padded: bool) -> None:
    bpp = 2
    dev = filled_device(32, device)
    host = HostPages(12, bpp * dev.block_nbytes + (64 if padded else 0))
    copier = PageCopier(dev, host, bpp)
    src_blocks = [5, 9, 0, 31, 17, 18, 2, 3]  # 4 pages of 2 blocks, any order
    pages = [7, 1, 10, 4] if scattered else [3, 4, 5, 6]
    original = dev.tensor.clone()

    job = copier.submit(D2H, src_blocks, pages)
    done = copier.wait(job, timeout_s=30)
    assert (done.num_pages, done.nbytes) == (4, 4 * copier.page_used_nbytes)
    # page j holds blocks src_blocks[2j], src_blocks[2j + 1] back to back, byte for byte
    for j, page in enumerate(pages):
        expected = original[src_blocks[2 * j : 2 * j + 2]].cpu().contiguous().view(torch.uint8)
        got = bytes(host.page_view(page)[: copier.page_used_nbytes])
        assert got == expected.numpy().tobytes()

    dev.tensor.zero_()
    dst_blocks = [20, 21, 1, 2, 30, 29, 11, 12]
    job = copier.submit(H2D, dst_blocks, pages)
    assert copier.wait(job, timeout_s=30).direction is H2D
    assert torch.equal(dev.tensor[dst_blocks].cpu(), original[src_blocks].cpu())
    untouched = [b for b in range(32) if b not in dst_blocks]
    assert not dev.tensor[untouched].any()
    assert copier.in_flight == 0


@pytest.mark.parametrize("scattered", [False, True], ids=["run", "scattered"])
@pytest.mark.parametrize("padded", [False, True], ids=["full_page", "padded_page"])
def test_round_trip_is_exact(scattered: bool, padded: bool) -> None:
    round_trip(default_device(), scattered=scattered, padded=padded)


@pytest.mark.gpu
@pytest.mark.parametrize("scattered", [False, True], ids=["run", "scattered"])
@pytest.mark.parametrize("padded", [False, True], ids=["full_page", "padded_page"])
def test_round_trip_is_exact_on_cuda(scattered: bool, padded: bool) -> None:
    host = HostPages(1, 1)
    assert host.pinned
    round_trip(torch.device("cuda"), scattered=scattered, padded=padded)


def test_each_job_is_reported_once_by_poll_or_wait() -> None:
    dev = filled_device(8, default_device())
    copier = PageCopier(dev, HostPages(8, dev.block_nbytes), 1)
    a = copier.submit(D2H, [0, 1], [0, 1])
    b = copier.submit(D2H, [2], [5])
    assert copier.wait(b, timeout_s=30).job_id == b
    assert [c.job_id for c in copier.poll()] == [a]
    assert copier.poll() == []
    with pytest.raises(PageCopyError):
        copier.wait(a, timeout_s=1)
    c = copier.submit(H2D, [3], [5])
    assert [d.job_id for d in copier.wait_all(timeout_s=30)] == [c]


def test_invalid_jobs_are_refused_before_any_copy() -> None:
    dev = filled_device(4, default_device())
    copier = PageCopier(dev, HostPages(2, 2 * dev.block_nbytes), 2)
    with pytest.raises(ValueError):
        copier.submit(D2H, [0], [0])  # two blocks per page
    with pytest.raises(ValueError):
        copier.submit(D2H, [0, 4], [0])  # block out of range
    with pytest.raises(ValueError):
        copier.submit(D2H, [0, 1], [2])  # page out of range
    with pytest.raises(ValueError):
        copier.submit(D2H, [], [])
    with pytest.raises(ValueError):
        PageCopier(dev, HostPages(2, dev.block_nbytes), 2)  # does not fit a page
    assert copier.in_flight == 0


def test_host_pages_are_zero_copy_memoryviews() -> None:
    host = HostPages(3, 16)
    view = host.page_view(2)
    view[:4] = b"\x01\x02\x03\x04"
    assert host.tensor[2, :4].tolist() == [1, 2, 3, 4]
    host.tensor[1, 15] = 9
    assert host.page_view(1)[15] == 9
    assert host.pinned == torch.cuda.is_available()
    with pytest.raises(IndexError):
        host.page_view(3)


def test_pool_over_host_pages_stores_and_serves_device_blocks() -> None:
    """A store through the pool: allocate, copy GPU→host into the page, complete, read by ref."""
    dev = filled_device(8, default_device(), seed=3)
    host = HostPages(2, dev.block_nbytes)
    pool = HostPagePool(host)
    copier = PageCopier(dev, host, 1)
    a = pool.allocate(key(1))
    copier.wait(copier.submit(D2H, [6], [a.index]), timeout_s=30)
    pool.complete_write(key(1), True)
    b = pool.allocate(key(2))
    assert pool.lookup(key(2)) is LookupResult.HIT_PENDING
    with pool.acquire(key(1)) as ref:
        expected = dev.tensor[6].cpu().contiguous().view(torch.uint8).numpy().tobytes()
        assert bytes(ref.view) == expected
        with pytest.raises(PoolExhausted):  # one page read, one being written: nothing to evict
            pool.allocate(key(3))
    pool.complete_write(key(2), False)
    assert pool.allocate(key(3)).index == b.index
    assert pool.stats().refusals == 1


def test_odd_sized_blocks_copy_bytewise() -> None:
    """Blocks whose size no wide word divides still round-trip (the copier falls back to bytes)."""
    kv = torch.arange(6 * 5, dtype=torch.uint8).reshape(6, 5).to(default_device())
    dev = DevicePages(kv)
    host = HostPages(3, 11)
    copier = PageCopier(dev, host, 2)
    copier.wait(copier.submit(D2H, [5, 0, 3, 2], [2, 0]), timeout_s=30)
    assert bytes(host.page_view(2)[:10]) == bytes(kv[[5, 0]].cpu().reshape(-1).tolist())
    dev.tensor.zero_()
    copier.wait(copier.submit(H2D, [1, 4, 0, 5], [2, 0]), timeout_s=30)
    assert dev.tensor[1].tolist() == list(range(25, 30)) and dev.tensor[4].tolist() == [
        0,
        1,
        2,
        3,
        4,
    ]


def test_device_pages_need_a_contiguous_block_major_tensor() -> None:
    with pytest.raises(ValueError):
        DevicePages(torch.zeros((4, 6)).t())
    dev = DevicePages.allocate(3, (2, 4), torch.float32)
    assert (dev.num_blocks, dev.block_nbytes, dev.device) == (3, 32, default_device())
