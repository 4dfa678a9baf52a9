"""Consumer installs: each receive's pages are verified as they land and committed together,
in arrival order (one ``complete_writes``: one listener call per receive)."""

from __future__ import annotations

import pytest

from kvtier.errors import IntegrityError
from kvtier.keys import OffloadKey
from kvtier.offload.pool import BytearrayPageBuffer, HostPagePool
from kvtier.offload.types import LookupResult
from kvtier.p2p import PoolSink
from kvtier.p2p.channel import UnverifiedPayload
from kvtier.p2p.installs import PageInstaller, Received
from kvtier.p2p.sealing import PageOpener, PageSealer
from kvtier.p2p.sink import AlreadyHeld

from .conftest import PAGE, make_keys, payload


class Consumer:
    """A pool, its sink, the commits its write listener saw, and pages to receive."""

    def __init__(self) -> None:
        self.pool = HostPagePool(BytearrayPageBuffer(8, PAGE))
        self.sink = PoolSink(self.pool)
        self.commits: list[tuple[tuple[OffloadKey, ...], bool]] = []
        self.pool.add_write_listener(lambda keys, ok: self.commits.append((tuple(keys), ok)))
        self.sealer = PageSealer()
        self.opener = PageOpener(self.sealer.key)
        self.installed: list[OffloadKey] = []
        self.nbytes = 0

    def on_installed(self, keys: list[OffloadKey], nbytes: int) -> None:
        self.installed.extend(keys)
        self.nbytes += nbytes

    def received(self, key: OffloadKey, *, forged: bool = False) -> Received:
        """``key``'s page received whole into its reservation (``forged``: one byte flipped
        after the producer tagged it)."""
        reservation = self.sink.reserve(key, PAGE)
        assert reservation is not None and not isinstance(reservation, AlreadyHeld)
        data = bytearray(payload(key))
        tag = self.sealer.tag(data)
        if forged:
            data[100] ^= 1
        reservation.buffer[:] = data
        return Received(key, reservation, UnverifiedPayload(self.opener, reservation.buffer, tag))


def test_each_receive_is_verified_and_committed_as_one_step_in_order() -> None:
    consumer = Consumer()
    installs = PageInstaller(consumer.sink, consumer.on_installed)
    keys = make_keys(4)
    first = [consumer.received(keys[0])]
    later = [consumer.received(k) for k in keys[1:]]
    # Reserved pages are not readable before their receive is verified.
    assert all(consumer.pool.lookup(k) is LookupResult.HIT_PENDING for k in keys)
    installs.add(first)
    assert consumer.commits == [((keys[0],), True)]
    assert consumer.pool.lookup(keys[1]) is LookupResult.HIT_PENDING
    installs.add(later)

    assert consumer.commits == [((keys[0],), True), (tuple(keys[1:]), True)]
    assert consumer.installed == keys and consumer.nbytes == 4 * PAGE
    assert all(consumer.pool.lookup(k) is LookupResult.HIT for k in keys)
    ref = consumer.pool.acquire(keys[2])
    assert bytes(ref.view) == payload(keys[2])
    ref.release()
    assert installs.failure is None


def test_a_forged_page_commits_the_verified_prefix_of_its_receive_and_aborts_the_rest() -> None:
    consumer = Consumer()
    installs = PageInstaller(consumer.sink, consumer.on_installed)
    keys = make_keys(4)
    installs.add([consumer.received(keys[0])])
    pages = [
        consumer.received(keys[1]),
        consumer.received(keys[2], forged=True),
        consumer.received(keys[3]),
    ]
    with pytest.raises(IntegrityError):
        installs.add(pages)

    assert consumer.commits == [
        ((keys[0],), True),
        ((keys[1],), True),
        ((keys[2],), False),
        ((keys[3],), False),
    ]
    assert consumer.installed == keys[:2]
    assert consumer.pool.lookup(keys[2]) is LookupResult.MISS
    assert consumer.pool.lookup(keys[3]) is LookupResult.MISS
    assert isinstance(installs.failure, IntegrityError)
    late = consumer.received(make_keys(1, start=100)[0])
    with pytest.raises(IntegrityError):  # a page after the failure is aborted unverified
        installs.add([late])
    assert consumer.pool.lookup(late.key) is LookupResult.MISS


def test_a_sink_commits_only_its_own_reservations() -> None:
    consumer, other = Consumer(), Consumer()
    key = make_keys(1)[0]
    foreign = other.received(key)
    with pytest.raises(TypeError):
        consumer.sink.commit([foreign.reservation])
    assert other.pool.lookup(key) is LookupResult.HIT_PENDING
    other.sink.commit([foreign.reservation, foreign.reservation])  # the repeat is skipped
    assert other.commits == [((key,), True)]
    foreign.reservation.abort()  # after the commit: changes nothing
    assert other.pool.lookup(key) is LookupResult.HIT
