"""Before authentication a peer gets a bounded handshake and nothing else.

Rules under test (each played by an attacker, each with a legitimate control that is served):
frames before authentication are capped at a few KiB; handshakes per source address are rate
limited (token bucket; an authenticated handshake gives its token back); unauthenticated
connections are capped per address and in all; ``max_connections`` counts authenticated
sessions only; refused connections are counted, never logged one by one.
"""

from __future__ import annotations

import asyncio
import logging
import socket

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.p2p.admission import HandshakeAdmission
from kvtier.p2p.frames import HANDSHAKE_MAX_FRAME_BYTES, LENGTH_PREFIX, Hello

from .blocking_peer import BlockingPeer, recv_plain_frame
from .conftest import FINGERPRINT, make_pair, settings, wait_until


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Conn:
    """A pending connection as the admission sees it: evicting it only marks it."""

    def __init__(self, name: str = "") -> None:
        self.name = name
        self.evicted = False

    def evict(self) -> None:
        self.evicted = True


def admit(gate: HandshakeAdmission[Conn], peer: str, conn: Conn | None = None) -> str | None:
    return gate.begin(peer, conn if conn is not None else Conn(peer))


def admission(clock: Clock, **overrides: float) -> HandshakeAdmission[Conn]:
    params: dict[str, float] = {
        "rate_per_s": 2.0,
        "burst": 3,
        "max_pending": 100,
        "max_pending_per_peer": 100,
    }
    params.update(overrides)
    return HandshakeAdmission(
        rate_per_s=params["rate_per_s"],
        burst=int(params["burst"]),
        max_pending=int(params["max_pending"]),
        max_pending_per_peer=int(params["max_pending_per_peer"]),
        clock=clock,
    )


def test_token_bucket_per_peer() -> None:
    clock = Clock()
    gate = admission(clock)
    for _ in range(3):
        conn = Conn()
        assert gate.begin("10.0.0.1", conn) is None
        gate.end("10.0.0.1", conn, authenticated=False)
    assert admit(gate, "10.0.0.1") == "handshake rate limit"
    assert admit(gate, "10.0.0.2") is None  # another address has its own bucket
    clock.now += 0.5  # one token at 2/s
    assert admit(gate, "10.0.0.1") is None
    assert admit(gate, "10.0.0.1") == "handshake rate limit"


def test_authenticated_handshakes_give_their_token_back() -> None:
    gate = admission(Clock())
    for _ in range(50):  # a legitimate consumer reconnecting often is never throttled
        conn = Conn()
        assert gate.begin("10.0.0.1", conn) is None
        gate.end("10.0.0.1", conn, authenticated=True)
    assert gate.pending_total == 0


def test_pending_caps_per_peer_and_in_all() -> None:
    """Per address a cap refuses; in all, a full set evicts (issue 30: refusing the newcomer
    let 4 addresses x 32 silent connections starve every legitimate peer)."""
    gate = admission(Clock(), burst=100, max_pending=5, max_pending_per_peer=2)
    a = [Conn("a0"), Conn("a1")]
    assert gate.begin("a", a[0]) is None and gate.begin("a", a[1]) is None
    assert admit(gate, "a") == "too many handshakes in progress from this peer"
    for peer in ("b", "c", "d"):
        assert admit(gate, peer) is None
    e = Conn("e")
    assert gate.begin("e", e) is None  # full: "a" holds the most, its oldest goes
    assert a[0].evicted and not a[1].evicted and not e.evicted
    assert gate.pending_total == 5 and gate.evicted_total == 1
    gate.end("a", a[0], authenticated=False)  # the evicted one's end changes nothing
    assert gate.pending_total == 5
    gate.end("a", a[1], authenticated=False)
    assert gate.pending_total == 4 and admit(gate, "f") is None and gate.evicted_total == 1


def test_forgotten_peers_bound_the_table() -> None:
    clock = Clock()
    gate: HandshakeAdmission[Conn] = HandshakeAdmission(
        rate_per_s=0.001, burst=1, max_pending=10, max_pending_per_peer=10, clock=clock,
        max_tracked_peers=2,
    )  # fmt: skip
    for peer in ("a", "b", "c"):
        conn = Conn()
        assert gate.begin(peer, conn) is None
        gate.end(peer, conn, authenticated=False)
    # "a" was forgotten (least recently seen) and starts over; "c" is still remembered.
    assert admit(gate, "c") == "handshake rate limit"
    assert admit(gate, "a") is None


@given(st.lists(st.tuples(st.sampled_from("abc"), st.floats(0, 2)), max_size=60))
def test_admitted_handshakes_never_exceed_burst_plus_rate(ops: list[tuple[str, float]]) -> None:
    """Invariant: without authenticated refunds, a peer is admitted at most ``burst + rate *
    elapsed`` times."""
    clock = Clock()
    start = clock.now
    gate = admission(clock)
    admitted = dict.fromkeys("abc", 0)
    for peer, wait in ops:
        clock.now += wait
        conn = Conn()
        if gate.begin(peer, conn) is None:
            admitted[peer] += 1
            gate.end(peer, conn, authenticated=False)
        assert admitted[peer] <= 3 + 2.0 * (clock.now - start) + 1e-9
    assert gate.pending_total == 0


def test_a_full_set_evicts_the_oldest_of_the_busiest_source() -> None:
    gate = admission(Clock(), burst=100, max_pending=5, max_pending_per_peer=3)
    a = [Conn(f"a{i}") for i in range(3)]
    b = [Conn(f"b{i}") for i in range(2)]
    for conn in (b[0], a[0], a[1], b[1], a[2]):
        assert gate.begin(conn.name[0], conn) is None
    legit = Conn("legit")
    assert gate.begin("c", legit) is None
    # "a" holds 3 of 5: its oldest goes, not b's older one, and not the newcomer.
    assert [c.name for c in (*a, *b) if c.evicted] == ["a0"]
    # Equal counts ("a" and "b" hold 2 each): the oldest connection among them goes.
    assert admit(gate, "d") is None
    assert [c.name for c in (*a, *b) if c.evicted] == ["a0", "b0"]
    # The busiest source displaces only itself.
    assert admit(gate, "a") is None
    assert [c.name for c in (*a, *b) if c.evicted] == ["a0", "a1", "b0"]
    assert not legit.evicted and gate.evicted_total == 3 and gate.pending_total == 5


def test_many_single_connection_sources_evict_the_oldest() -> None:
    gate = admission(Clock(), burst=100, max_pending=4, max_pending_per_peer=4)
    conns = [Conn(f"s{i}") for i in range(10)]
    for i, conn in enumerate(conns):
        assert gate.begin(f"10.0.0.{i}", conn) is None
    assert [c.evicted for c in conns] == [True] * 6 + [False] * 4
    assert gate.pending_total == 4 and gate.evicted_total == 6


@given(st.lists(st.tuples(st.sampled_from("abcd"), st.booleans()), max_size=80))
def test_eviction_never_takes_a_lone_handshake_while_another_source_holds_more(
    ops: list[tuple[str, bool]],
) -> None:
    """Invariants: at most ``max_pending`` in all and ``max_pending_per_peer`` per source; a
    source with one pending handshake loses it only when no source holds two."""
    gate = admission(Clock(), burst=1000, max_pending=6, max_pending_per_peer=4)
    pending: dict[str, list[Conn]] = {peer: [] for peer in "abcd"}
    for peer, finish in ops:
        if finish and pending[peer]:
            conn = pending[peer].pop(0)
            gate.end(peer, conn, authenticated=False)
            continue
        before = {p: len(c) for p, c in pending.items()}
        conn = Conn(peer)
        if gate.begin(peer, conn) is None:
            pending[peer].append(conn)
        for p, conns in pending.items():
            gone = [c for c in conns if c.evicted]
            if gone:
                assert before[p] >= max(before.values()), (p, before)
                assert before[p] > 1 or max(before.values()) <= 1, (p, before)
            pending[p] = [c for c in conns if not c.evicted]
        assert gate.pending_total == sum(map(len, pending.values())) <= 6
        assert all(len(c) <= 4 for c in pending.values())


# ---- against a live server ---------------------------------------------------------------------


def _connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    sock = socket.socket()
    sock.bind((source, 0))
    sock.settimeout(3)
    sock.connect(("127.0.0.1", port))
    return sock


def _closed_without_answer(sock: socket.socket) -> bool:
    """True when the server closed the connection without sending a frame."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


async def test_oversize_frame_before_auth_is_refused_at_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pair = await make_pair(settings(handshake_timeout_s=30.0))
    caplog.clear()
    try:

        def attack() -> None:
            for announced in (4 << 20, HANDSHAKE_MAX_FRAME_BYTES + 1):
                sock = _connect(pair.port)
                try:
                    assert isinstance(recv_plain_frame(sock), Hello)
                    sock.sendall(LENGTH_PREFIX.pack(announced))  # then nothing: a slow peer
                    # Closed on the prefix alone: no body is awaited (the handshake timeout is
                    # 30 s, this socket's 3 s), so nothing of that size is ever allocated.
                    assert sock.recv(1) == b""
                finally:
                    sock.close()

        await asyncio.to_thread(attack)
        await wait_until(lambda: pair.server.stats().handshake_failures_total == 2)
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        control = await asyncio.to_thread(_handshake_ok, pair.port, "127.0.0.1")
        assert control == "producer"
    finally:
        await pair.client.close()
        await pair.server.stop()


def _handshake_ok(port: int, source: str) -> str:
    sock = _connect(port, source)
    try:
        return BlockingPeer(sock, FINGERPRINT).server_node_id
    finally:
        sock.close()


async def test_handshake_flood_is_throttled_per_peer_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="kvtier.p2p")
    config = settings(
        max_pending_handshakes_per_peer=4,
        handshake_burst=6,
        handshake_rate_per_s=0.001,
        handshake_timeout_s=5.0,
    )
    pair = await make_pair(config)
    try:

        def flood() -> list[socket.socket]:
            held = [_connect(pair.port, "127.0.0.7") for _ in range(4)]  # silent: never answer
            extra = _connect(pair.port, "127.0.0.7")
            try:
                assert recv_plain_frame(held[0]) is not None  # the held ones got a hello
                assert _closed_without_answer(extra)  # the 5th: closed on accept
            finally:
                extra.close()
            return held

        held = await asyncio.to_thread(flood)
        assert pair.server.stats().handshakes == 4
        # A legitimate peer elsewhere is served meanwhile, and its session is not a handshake.
        assert await asyncio.to_thread(_handshake_ok, pair.port, "127.0.0.8") == "producer"
        for sock in held:
            sock.close()
        await wait_until(lambda: pair.server.stats().handshakes == 0)

        def exhaust() -> int:
            closed = 0
            # 6 tokens: the 4 held handshakes spent 4 and gave none back (never authenticated);
            # the 5th was refused by the pending cap before taking one. 2 left.
            for _ in range(4):
                sock = _connect(pair.port, "127.0.0.7")
                try:
                    sock.shutdown(socket.SHUT_WR)  # a peer that hangs up: a failed handshake
                    try:
                        first = sock.recv(1)
                    except ConnectionResetError:
                        first = b""
                    closed += first == b""
                finally:
                    sock.close()
            return closed

        closed_on_accept = await asyncio.to_thread(exhaust)
        stats = pair.server.stats()
        assert stats.throttled_total == 1 + 2, stats  # the 5th above, and the bucket ran dry
        assert closed_on_accept == 2
        # Counted, not logged: no record above DEBUG names a refused or throttled peer.
        loud = [
            r.getMessage()
            for r in caplog.records
            if r.levelno > logging.DEBUG and r.name.startswith("kvtier.p2p.server")
        ]
        assert not [m for m in loud if "127.0.0.7" in m], loud
    finally:
        await pair.client.close()
        await pair.server.stop()


async def test_max_connections_counts_only_authenticated_sessions() -> None:
    pair = await make_pair(settings(max_connections=1, handshake_timeout_s=5.0))
    try:

        def scenario() -> None:
            silent = [_connect(pair.port, "127.0.0.9") for _ in range(3)]  # handshakes, no slot
            try:
                a = _connect(pair.port)
                peer = BlockingPeer(a, FINGERPRINT)  # the one session slot: still free
                try:
                    b = _connect(pair.port)
                    with pytest.raises(AssertionError, match="Refuse"):
                        BlockingPeer(b, FINGERPRINT)  # authenticated, but no slot left
                    b.close()
                finally:
                    a.close()
                del peer
            finally:
                for sock in silent:
                    sock.close()

        await asyncio.to_thread(scenario)
        stats = pair.server.stats()
        assert stats.busy_total == 1 and stats.authenticated_total == 1, stats
    finally:
        await pair.client.close()
        await pair.server.stop()
