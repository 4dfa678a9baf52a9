"""Malformed input of any kind closes only that connection, with a logged reason, leaking nothing.

A real server runs on its own event loop thread; hypothesis drives blocking sockets at it."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.errors import ProtocolError
from kvtier.keys import OFFLOAD_KEY_BYTES, OffloadKey
from kvtier.p2p.frames import (
    LENGTH_PREFIX,
    MAX_BLOCKS_PER_FRAME,
    MAX_PAGE_NONCE,
    WRAPPED_PAGE_KEY_BYTES,
    Auth,
    BlockBatch,
    BlockHeader,
    Done,
    Fail,
    Fetch,
    Frame,
    Hello,
    KvRequestId,
    PeerNodeId,
    Refuse,
    Release,
    Welcome,
    decode_frame,
    encode_frame,
)
from kvtier.p2p.layout import LayoutFingerprint

from . import conftest
from .blocking_peer import BlockingPeer
from .conftest import FINGERPRINT, Pair, make_keys, make_pair, producer_ctx, write_page

T = TypeVar("T")
GONE = KvRequestId("released-before-fuzzing")

keys_st = st.lists(st.binary(min_size=OFFLOAD_KEY_BYTES, max_size=OFFLOAD_KEY_BYTES), max_size=8)
rid_st = st.text(min_size=1, max_size=40)
fingerprint_st = st.one_of(
    st.just(FINGERPRINT),
    st.builds(
        LayoutFingerprint,
        st.text(max_size=20),
        st.integers(1, 64),
        st.sampled_from(["uint8", "float16"]),
        st.lists(st.integers(1, 1 << 20), min_size=1, max_size=3).map(tuple),
    ),
)
frames_st: st.SearchStrategy[Frame] = st.one_of(
    st.builds(
        Fetch,
        rid_st.map(KvRequestId),
        keys_st.map(lambda ks: tuple(OffloadKey(k) for k in ks)),
        st.integers(0, 3_600_000),
    ),
    st.lists(
        st.builds(
            BlockHeader,
            st.binary(min_size=OFFLOAD_KEY_BYTES, max_size=OFFLOAD_KEY_BYTES).map(OffloadKey),
            st.integers(1, 1 << 31),
            st.binary(min_size=16, max_size=16),
            st.integers(0, MAX_PAGE_NONCE),
        ),
        min_size=1,
        max_size=MAX_BLOCKS_PER_FRAME,
    ).map(lambda blocks: BlockBatch(tuple(blocks))),
    st.builds(
        Fail,
        rid_st.map(KvRequestId),
        keys_st.map(lambda ks: tuple(OffloadKey(k) for k in ks)),
        st.text(max_size=100),
    ),
    st.builds(Done, rid_st.map(KvRequestId)),
    st.builds(Release, rid_st.map(KvRequestId)),
    st.builds(Refuse, st.text(max_size=100)),
    st.builds(
        Auth,
        st.integers(0, 3),
        st.text(max_size=20).map(PeerNodeId),
        fingerprint_st,
        st.binary(min_size=32, max_size=32),
        st.binary(min_size=32, max_size=32),
    ),
    st.builds(
        Hello,
        st.integers(0, 3),
        st.text(max_size=20).map(PeerNodeId),
        fingerprint_st,
        st.binary(min_size=32, max_size=32),
        st.booleans(),
    ),
    st.builds(
        Welcome,
        st.binary(min_size=32, max_size=32),
        st.binary(min_size=WRAPPED_PAGE_KEY_BYTES, max_size=WRAPPED_PAGE_KEY_BYTES),
    ),
)


@given(frames_st)
def test_frames_round_trip(frame: Frame) -> None:
    data = encode_frame(frame)
    (n,) = LENGTH_PREFIX.unpack(data[:4])
    assert n == len(data) - 4
    assert decode_frame(data[4:]) == frame


@given(st.binary(max_size=300))
def test_decode_garbage_raises_only_protocol_error(body: bytes) -> None:
    _decodes_or_refuses(body)


@given(frames_st, st.data())
def test_mutated_frames_raise_only_protocol_error(frame: Frame, data: st.DataObject) -> None:
    body = bytearray(encode_frame(frame)[4:])
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(body) - 1))
        body[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(1, len(body)))
    _decodes_or_refuses(bytes(body[:cut]))


def _decodes_or_refuses(body: bytes) -> None:
    try:
        frame = decode_frame(body)
    except ProtocolError as exc:
        assert str(exc)  # a reason to log
    else:
        assert isinstance(frame, Frame.__args__)


# ---- against a live server ---------------------------------------------------------------------


@dataclass
class LiveServer:
    pair: Pair
    loop: asyncio.AbstractEventLoop

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)


@pytest.fixture(scope="module")
def live() -> Iterator[LiveServer]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    overrides = {"handshake_timeout_s": 1.0, "idle_session_s": 2.0, "max_frame_bytes": 4096}
    server_settings = conftest.settings(**overrides)
    pair = asyncio.run_coroutine_threadsafe(make_pair(server_settings), loop).result(10)
    pair.registry.open(GONE)
    pair.registry.release(GONE, "fixture")
    live = LiveServer(pair, loop)
    try:
        yield live
    finally:
        live.call(pair.client.close())
        live.call(pair.server.stop())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def _handshake(sock: socket.socket) -> BlockingPeer:
    return BlockingPeer(sock, FINGERPRINT, node_id="fuzzer")


def _drain_until_closed(sock: socket.socket, timeout: float = 3.0) -> None:
    """Read until the server closes (it must, once our write side is shut)."""
    deadline = time.monotonic() + timeout
    sock.settimeout(0.2)
    while time.monotonic() < deadline:
        try:
            if not sock.recv(65536):
                return
        except TimeoutError:
            continue
        except OSError:
            return
    raise AssertionError("server kept the connection open")


def _frame_bytes(frame: Frame) -> bytes:
    return encode_frame(frame)


chunk_st = st.one_of(
    st.binary(max_size=64),
    frames_st.map(_frame_bytes),
    st.integers(0, 2**32 - 1).map(LENGTH_PREFIX.pack),
    st.binary(max_size=64).map(lambda b: LENGTH_PREFIX.pack(len(b)) + b),
)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(st.booleans(), st.lists(chunk_st, min_size=1, max_size=5))
def test_garbage_closes_only_that_connection(
    live: LiveServer, after_handshake: bool, chunks: list[bytes]
) -> None:
    bystander_sock = socket.create_connection(("127.0.0.1", live.pair.port), timeout=3)
    victim = socket.create_connection(("127.0.0.1", live.pair.port), timeout=3)
    try:
        bystander = _handshake(bystander_sock)
        if after_handshake:
            _handshake(victim)
        try:
            for chunk in chunks:
                victim.sendall(chunk)
            victim.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the server may already have closed on the first bad byte
        _drain_until_closed(victim)
        # The other session is unaffected: it still gets answers.
        bystander.send(Fetch(GONE, tuple(make_keys(1)), 1000))
        answer = bystander.read()
        assert isinstance(answer, Fail) and "released" in answer.reason
    finally:
        victim.close()
        bystander_sock.close()


def test_live_server_leaks_nothing_after_fuzzing(live: LiveServer) -> None:
    """Runs after the fuzz test (module order): a real fetch works and nothing is held."""
    pair = live.pair

    async def scenario() -> None:
        deadline = time.monotonic() + 3
        while pair.server.active_connections and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        k = KvRequestId("after-fuzz")
        keys = make_keys(4, start=777)
        ctx = producer_ctx(k)
        pair.tier.on_new_request(ctx)
        for key in keys:
            write_page(pair.producer_pool, key)
        pair.tier.submit_store(keys, ctx)
        pair.tier.on_request_finished(ctx)
        result = await pair.fetch(k, keys)
        assert result.complete
        while pair.registry.stats().requests and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    live.call(scenario())
    assert pair.server.active_connections <= 1  # at most the client's idle session
    pair.assert_baseline()


def test_consumer_sending_a_block_is_a_protocol_error(live: LiveServer) -> None:
    sock = socket.create_connection(("127.0.0.1", live.pair.port), timeout=3)
    try:
        peer = _handshake(sock)
        # A consumer never sends block headers: that alone is a protocol error.
        peer.send(BlockBatch((BlockHeader(OffloadKey(b"\x00" * 18), 4, bytes(16)),)))
        sock.sendall(b"abcd")
        _drain_until_closed(sock)
    finally:
        sock.close()
    assert live.pair.server.protocol_errors_total >= 1
