"""The scheduler side's offers for ``remote_kv_source`` (no vLLM needed): an ask never waits,
answers "not known yet" until the holder answered, and every supply the holder pinned is
either claimed (then fetched or released by the scheduler) or released by the desk — also when
the request is gone before the answer comes. The holder here is a small fake client whose
answers the test releases by hand; the network thread is the connector's real one."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.keys import OffloadKey
from kvtier.offload.buffer import BytearrayPageBuffer
from kvtier.offload.pool import HostPagePool
from kvtier.offload.types import LookupResult
from kvtier.p2p import PoolSink
from kvtier.p2p.sink import AlreadyHeld
from kvtier.vllm.errors import KvtierConnectorConfigError
from kvtier.vllm.loop import NetworkThread
from kvtier.vllm.offers import NoPages, Offer, OfferDesk, tokens_to_load
from kvtier.vllm.settings import KvtierConnectorSettings
from kvtier.worker.kv_params import KvSource

SOURCE = KvSource("127.0.0.1", 7701, "holder-1")
KEYS = [OffloadKey(bytes([i]) * 20) for i in range(4)]


@dataclass(frozen=True, slots=True)
class _Answer:
    kv_request_id: str | None
    num_held: int
    reason: str | None = None


@dataclass
class FakeHolder:
    """Answers offers when the test says so; records releases (any thread)."""

    held: int
    gate: threading.Event = field(default_factory=threading.Event)
    offers: list[tuple[str, int, tuple[OffloadKey, ...], str | None]] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    next_id: int = 0
    broken: bool = False

    async def offer(
        self,
        remote_host: str,
        remote_port: int,
        keys: Sequence[OffloadKey],
        *,
        expected_node_id: str | None = None,
        deadline: float | None = None,
    ) -> _Answer:
        self.offers.append((remote_host, remote_port, tuple(keys), expected_node_id))
        await asyncio.to_thread(self.gate.wait, 10.0)
        if self.broken:
            raise RuntimeError("a bug in the offer path")
        if self.held == 0:
            return _Answer(None, 0, "nothing held")
        self.next_id += 1
        return _Answer(f"K2-{self.next_id}", min(self.held, len(keys)))

    async def release(
        self,
        remote_host: str,
        remote_port: int,
        kv_request_id: str,
        deadline: float | None = None,
        *,
        expected_node_id: str | None = None,
    ) -> bool:
        self.released.append(kv_request_id)
        return True


@pytest.fixture
def net() -> Iterator[NetworkThread]:
    thread = NetworkThread("test-offers")
    thread.start()
    yield thread
    thread.stop(5.0)


def _desk(holder: FakeHolder, net: NetworkThread) -> OfferDesk:
    return OfferDesk(holder, net, offer_timeout_s=2.0, release_timeout_s=1.0)


def _settle(desk: OfferDesk, req_id: str) -> Offer:
    for _ in range(500):
        offer = desk.ask(req_id, SOURCE, KEYS)
        if offer is not None:
            return offer
        threading.Event().wait(0.01)
    raise AssertionError("the offer never ended")


def _until(condition: object, what: str) -> None:
    for _ in range(500):
        if callable(condition) and condition():
            return
        threading.Event().wait(0.01)
    raise AssertionError(what)


def test_ask_answers_not_yet_until_the_holder_answered(net: NetworkThread) -> None:
    holder = FakeHolder(held=3)
    desk = _desk(holder, net)
    assert desk.ask("r1", SOURCE, KEYS) is None
    assert desk.ask("r1", SOURCE, KEYS) is None  # asking again starts nothing new
    holder.gate.set()
    offer = _settle(desk, "r1")
    assert offer == Offer("K2-1", 3)
    assert holder.offers == [("127.0.0.1", 7701, tuple(KEYS), "holder-1")]
    assert desk.ask("r1", SOURCE, KEYS) == offer  # side-effect free once answered
    assert desk.claim("r1") == offer
    assert desk.in_flight() == 0 and holder.released == []  # claimed: the caller's to release


def test_dropped_before_the_answer_releases_when_it_comes(net: NetworkThread) -> None:
    holder = FakeHolder(held=2)
    desk = _desk(holder, net)
    assert desk.ask("r1", SOURCE, KEYS) is None
    desk.drop("r1")  # the request finished while its offer was in flight
    assert desk.claim("r1") is None
    holder.gate.set()
    _until(lambda: holder.released == ["K2-1"], "the pinned supply was not released")
    _until(lambda: desk.in_flight() == 0, "a release stayed in flight")


def test_dropped_after_the_answer_releases_now(net: NetworkThread) -> None:
    holder = FakeHolder(held=4)
    holder.gate.set()
    desk = _desk(holder, net)
    desk.ask("r1", SOURCE, KEYS)
    assert _settle(desk, "r1").kv_request_id == "K2-1"
    desk.drop("r1")
    desk.drop("r1")  # twice: released once
    _until(lambda: holder.released == ["K2-1"], "the pinned supply was not released")


def test_nothing_held_and_broken_offers_pin_nothing(net: NetworkThread) -> None:
    holder = FakeHolder(held=0)
    holder.gate.set()
    desk = _desk(holder, net)
    desk.ask("r1", SOURCE, KEYS)
    assert _settle(desk, "r1") == Offer(None, 0, "nothing held")
    broken = FakeHolder(held=3, broken=True)
    broken.gate.set()
    desk2 = _desk(broken, net)
    desk2.ask("r2", SOURCE, KEYS)
    offer = _settle(desk2, "r2")
    assert offer.kv_request_id is None and "bug in the offer path" in (offer.reason or "")
    desk.drop("r1")
    desk2.drop("r2")
    assert holder.released == broken.released == []


def test_close_releases_every_unclaimed_answer(net: NetworkThread) -> None:
    holder = FakeHolder(held=1)
    holder.gate.set()
    closed = threading.Event()
    desk = OfferDesk(holder, net, offer_timeout_s=2.0, release_timeout_s=1.0, on_close=closed.set)
    for req in ("a", "b", "c"):
        desk.ask(req, SOURCE, KEYS)
    for req in ("a", "b", "c"):
        _settle(desk, req)
    claimed = desk.claim("b")
    assert claimed is not None and claimed.kv_request_id is not None
    desk.close(timeout_s=5.0)
    assert sorted(holder.released) == sorted({"K2-1", "K2-2", "K2-3"} - {claimed.kv_request_id})
    assert closed.is_set()


def test_no_pages_sink_takes_nothing() -> None:
    sink = NoPages()
    assert not sink.holds(KEYS[0]) and sink.reserve(KEYS[0], 64) is None
    sink.commit([])  # nothing reserved, nothing to install
    pool = HostPagePool(BytearrayPageBuffer(1, 64))
    foreign = PoolSink(pool).reserve(KEYS[0], 64)
    assert foreign is not None and not isinstance(foreign, AlreadyHeld)
    with pytest.raises(TypeError):  # a page it never reserved is not installed through it
        sink.commit([foreign])
    assert pool.lookup(KEYS[0]) is LookupResult.HIT_PENDING


@given(
    held=st.integers(0, 12),
    full=st.integers(0, 12),
    computed_blocks=st.integers(0, 12),
    block_size=st.sampled_from([1, 16, 128]),
    pinned=st.booleans(),
)
def test_tokens_to_load_is_the_held_run_past_the_local_hit(
    held: int, full: int, computed_blocks: int, block_size: int, pinned: bool
) -> None:
    offer = Offer("K2" if pinned else None, held if pinned else 0)
    n = tokens_to_load(
        offer,
        num_computed_tokens=computed_blocks * block_size,
        num_full_blocks=full,
        block_size=block_size,
    )
    assert n % block_size == 0 and n >= 0
    end = computed_blocks * block_size + n
    # Never past the prompt's full blocks nor past what the holder pinned ...
    assert n == 0 or end <= min(held, full) * block_size
    # ... and everything up to there when there is anything to add.
    assert n == max(min(held, full) - computed_blocks, 0) * block_size if pinned else n == 0


def test_kv_source_holders_are_loopback_only_unless_allowed() -> None:
    default = KvtierConnectorSettings.from_extra_config({}).allowed_peers()
    assert default.allows("127.0.0.1", 7701) and default.allows("localhost", 1)
    assert not default.allows("10.0.0.7", 7701) and not default.allows("metadata.internal", 80)
    fabric = KvtierConnectorSettings.from_extra_config(
        {"kv_source_allowed_peers": ["10.0.0.0/8:7701"]}
    ).allowed_peers()
    assert fabric.allows("10.0.0.7", 7701) and not fabric.allows("10.0.0.7", 22)
    with pytest.raises(KvtierConnectorConfigError):
        KvtierConnectorSettings.from_extra_config({"kv_source_allowed_peers": ["[fd00::"]})
