"""P2P against hostile peers, with real worker processes: nothing is served to

- a consumer that does not know the shared secret (unauthenticated peer),
- a replayed handshake (a captured ``auth`` frame sent again on a fresh connection),
- a correctly authenticated peer that guesses a ``kv_request_id``;

and a consumer is never poisoned by

- an attacker it was made to connect to, who relays the handshake to the real producer and then
  forges or flips page bytes (issue 15's relay attack: the forged pages used to be installed in
  the consumer's shared prefix cache, and a later request with that prefix answered differently);
- a producer address that leads to another node than the one that answered the producer leg.

Each refusal is checked against a control that *is* served (same supply, same keys, legitimate
peer), so the test fails if the producer serves the attacker or stops serving anyone.
"""

from __future__ import annotations

import asyncio
import struct
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx
import msgpack
import pytest
from pydantic import SecretStr

from kvtier.keys import OffloadKey
from kvtier.p2p import LocalIdentity, P2PClient, P2PSettings, PeerNodeId
from kvtier.p2p.frames import Auth, Fetch, decode_frame, encode_frame
from kvtier.p2p.sealing import TAG_BYTES
from kvtier.p2p.sink import PageReservation
from tests.kvtier.p2p.attacker import RelayAttacker

from .faults import TcpRelay, replay_bytes
from .legs import completion, counter, metrics, producer_leg
from .procs import ProcessGroup
from .record import Tally
from .resources import ZERO_GAUGES, parse_metrics

pytestmark = pytest.mark.slow

_SECRET = "reliability-secret-" + uuid.uuid4().hex
_PROMPT = "Pages derived from users' prompts must never reach a stranger. " * 6


def _frames(data: bytes) -> list[dict[str, object]]:
    """Control frames at the start of ``data`` (stops at the first ``blocks`` frame)."""
    out: list[dict[str, object]] = []
    pos = 0
    while pos + 4 <= len(data):
        (length,) = struct.unpack_from(">I", data, pos)
        body = data[pos + 4 : pos + 4 + length]
        if len(body) < length:
            break
        frame = msgpack.unpackb(body, raw=False)
        out.append(frame)
        if frame.get("type") == "blocks":
            break
        pos += 4 + length
    return out


@dataclass
class _Reservation:
    sink: _MemorySink
    key: OffloadKey
    data: bytearray

    @property
    def buffer(self) -> memoryview:
        return memoryview(self.data)

    def abort(self) -> None:
        pass


@dataclass
class _MemorySink:
    """A consumer's host tier in this test process: fetched pages land in a dict."""

    pages: dict[OffloadKey, bytes] = field(default_factory=dict)

    def holds(self, key: OffloadKey) -> bool:
        return key in self.pages

    def reserve(self, key: OffloadKey, nbytes: int) -> _Reservation:
        return _Reservation(self, key, bytearray(nbytes))

    def commit(self, reservations: Sequence[PageReservation]) -> None:
        for reservation in reservations:
            assert isinstance(reservation, _Reservation) and reservation.sink is self
            self.pages[reservation.key] = bytes(reservation.data)


def _split_recording(recorded: bytes) -> tuple[Auth, Fetch]:
    """The legitimate consumer's ``auth`` and first ``fetch`` frames, from the relay's record."""
    auth = fetch = None
    pos = 0
    while pos + 4 <= len(recorded) and (auth is None or fetch is None):
        (length,) = struct.unpack_from(">I", recorded, pos)
        # After auth every frame is sealed: its last TAG_BYTES are the MAC (a relay reads the
        # plaintext body all the same).
        end = pos + 4 + length - (TAG_BYTES if auth is not None else 0)
        frame = decode_frame(recorded[pos + 4 : end])
        if isinstance(frame, Auth) and auth is None:
            auth = frame
        elif isinstance(frame, Fetch) and fetch is None and frame.keys:
            fetch = frame
        pos += 4 + length
    assert auth is not None and fetch is not None, "the relay recorded no auth+fetch"
    return auth, fetch


async def test_p2p_nothing_served_to_strangers(procs: ProcessGroup, tally: Tally) -> None:
    common = {"model": "sim", "secret": _SECRET, "wait": False}
    producer = procs.worker("p2p-producer", role="producer", **common)  # type: ignore[arg-type]
    consumer = procs.worker("p2p-consumer", role="consumer", **common)  # type: ignore[arg-type]
    stranger = procs.worker(
        "p2p-stranger", role="consumer", model="sim", secret="not-the-secret", wait=False
    )
    for w in (producer, consumer, stranger):
        w.wait_healthy()
    body = {"prompt": _PROMPT, "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    async with httpx.AsyncClient(timeout=60) as client, TcpRelay(producer.p2p_port) as relay:
        # 0. Reference: a single-node run (on the producer; the consumers stay cold).
        solo = await completion(client, producer.url, body)

        # 1. Control: the legitimate consumer is served (through a recording relay).
        supply = await producer_leg(client, producer.url, body)
        assert supply.num_blocks > 0
        served = await completion(
            client, consumer.url, body, supply.consumer_params(port=relay.port)
        )
        m = await metrics(client, consumer.url)
        assert counter(m, "p2p_blocks_fetched") > 0, "the legitimate consumer was not served"
        assert served["choices"][0]["token_ids"] == solo["choices"][0]["token_ids"]
        tally.ok()
        auth, recorded_fetch = _split_recording(bytes(relay.recorded))

        # 2. Unauthenticated peer: a consumer with the wrong secret gets nothing, recomputes.
        supply2 = await producer_leg(client, producer.url, body)
        answer = await completion(client, stranger.url, body, supply2.consumer_params())
        m = await metrics(client, stranger.url)
        assert counter(m, "p2p_blocks_fetched") == 0 and counter(m, "p2p_bytes_fetched") == 0
        assert counter(m, "p2p_fetch_failures") == 1
        assert answer["choices"][0]["token_ids"] == solo["choices"][0]["token_ids"]
        tally.ok(fallback=True)

        # 3. Replayed handshake: the recorded auth frame + a fetch for the live supply2.
        replayed_fetch = Fetch(supply2.kv_request_id, recorded_fetch.keys, 2000)  # type: ignore[arg-type]
        received = await replay_bytes(
            producer.p2p_port, encode_frame(auth) + encode_frame(replayed_fetch)
        )
        types = [f.get("type") for f in _frames(received)]
        assert types[:1] == ["hello"] and "blocks" not in types, types
        assert "refuse" in types, f"replayed handshake not refused: {types}"
        # Both refusals are visible to the operator on the producer's /metrics (never logged).
        m = await metrics(client, producer.url)
        assert counter(m, "p2p_server_refused") >= 2, m
        tally.ok()

        # 4. Authenticated peer, guessed kv_request_id: nothing; the right id: served (control).
        sink = _MemorySink()
        settings = P2PSettings(
            secret=SecretStr(_SECRET), fetch_timeout_s=3.0, unknown_request_wait_s=0.2
        )
        identity = LocalIdentity(PeerNodeId("guesser"), auth.fingerprint, _SECRET.encode())
        guesser = P2PClient(settings, identity, sink)
        keys = list(recorded_fetch.keys)
        try:
            loop = asyncio.get_running_loop()
            for guess in (uuid.uuid4().hex, supply2.kv_request_id[:-1] + "0", "0" * 32):
                if guess == supply2.kv_request_id:
                    continue
                got = await guesser.fetch(
                    "127.0.0.1", producer.p2p_port, guess, keys, loop.time() + 3
                )
                assert got.fetched == () and got.nbytes == 0 and not sink.pages, got
                tally.ok()
            control = await guesser.fetch(
                "127.0.0.1", producer.p2p_port, supply2.kv_request_id, keys, loop.time() + 5
            )
            assert control.fetched and len(sink.pages) == len(control.fetched), control
        finally:
            await guesser.close()

        # Nothing left held on the producer once the supplies are done or released.
        for kv_id in (supply.kv_request_id, supply2.kv_request_id):
            await client.post(f"{producer.url}/v1/kv/release", json={"kv_request_id": kv_id})
        for _ in range(100):
            gauges = parse_metrics((await client.get(f"{producer.url}/metrics")).text)
            if not any(gauges.get(g, 0.0) for g in ZERO_GAUGES):
                break
            await asyncio.sleep(0.05)
        held = {g: gauges[g] for g in ZERO_GAUGES if gauges.get(g, 0.0)}
        tally.leaks.extend(f"producer {k}={v:.0f}" for k, v in held.items())
        assert not held, held


async def test_p2p_relay_attack_cannot_poison_the_prefix_cache(
    procs: ProcessGroup, tally: Tally
) -> None:
    common = {"model": "sim", "secret": _SECRET, "wait": False}
    producer = procs.worker("p2p-producer", role="producer", **common)  # type: ignore[arg-type]
    consumer = procs.worker("p2p-consumer", role="consumer", **common)  # type: ignore[arg-type]
    for w in (producer, consumer):
        w.wait_healthy()
    async with httpx.AsyncClient(timeout=60) as client:
        for n, mode in enumerate(("forge", "flip")):
            body = {
                "prompt": f"{n}: tenant A's confidential prefix; " + _PROMPT,
                "max_tokens": 6,
                "temperature": 0,
                "return_token_ids": True,
            }
            solo = await completion(client, producer.url, body)
            supply = await producer_leg(client, producer.url, body)
            async with RelayAttacker(producer.p2p_port, mode) as attacker:
                answer = await completion(
                    client, consumer.url, body, supply.consumer_params(port=attacker.port)
                )
                assert attacker.handshakes_relayed >= 1 and attacker.payloads_tampered >= 1
            m = await metrics(client, consumer.url)
            assert counter(m, "p2p_blocks_fetched") == 0 and counter(m, "p2p_bytes_fetched") == 0
            assert counter(m, "p2p_fetch_failures") == n + 1
            # The consumer recomputed: the right answer, and its prefix cache holds its own KV.
            assert answer["choices"][0]["token_ids"] == solo["choices"][0]["token_ids"]
            later = await completion(client, consumer.url, body)  # another tenant, same prefix
            assert later["choices"][0]["token_ids"] == solo["choices"][0]["token_ids"]
            tally.ok(fallback=True)

        # Control: the same relay, changing nothing, delivers the pages (and the same answer).
        body = {"prompt": "2: " + _PROMPT, "max_tokens": 6, "temperature": 0}
        body["return_token_ids"] = True
        solo = await completion(client, producer.url, body)
        supply = await producer_leg(client, producer.url, body)
        async with RelayAttacker(producer.p2p_port, "relay") as relay:
            served = await completion(
                client, consumer.url, body, supply.consumer_params(port=relay.port)
            )
        m = await metrics(client, consumer.url)
        assert counter(m, "p2p_blocks_fetched") > 0
        assert served["choices"][0]["token_ids"] == solo["choices"][0]["token_ids"]
        tally.ok()


async def test_p2p_consumer_fetches_only_from_the_named_producer(
    procs: ProcessGroup, tally: Tally
) -> None:
    common = {"model": "sim", "secret": _SECRET, "wait": False}
    producer = procs.worker("p2p-producer", role="producer", **common)  # type: ignore[arg-type]
    consumer = procs.worker("p2p-consumer", role="consumer", **common)  # type: ignore[arg-type]
    for w in (producer, consumer):
        w.wait_healthy()
    body = {"prompt": _PROMPT, "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    async with httpx.AsyncClient(timeout=60) as client:
        solo = await completion(client, producer.url, body)
        supply = await producer_leg(client, producer.url, body)
        assert supply.engine_id, "the producer's answer names its node"
        wrong = supply.consumer_params(engine_id="some-other-producer")
        answer = await completion(client, consumer.url, body, wrong)
        m = await metrics(client, consumer.url)
        assert counter(m, "p2p_blocks_fetched") == 0 and counter(m, "p2p_fetch_failures") == 1
        assert answer["choices"][0]["token_ids"] == solo["choices"][0]["token_ids"]
        tally.ok(fallback=True)
        other = {**body, "prompt": "named: " + _PROMPT}
        solo = await completion(client, producer.url, other)
        supply = await producer_leg(client, producer.url, other)
        right = supply.consumer_params(engine_id=supply.engine_id)
        answer = await completion(client, consumer.url, other, right)
        m = await metrics(client, consumer.url)
        assert counter(m, "p2p_blocks_fetched") > 0, "the named producer was not served"
        assert answer["choices"][0]["token_ids"] == solo["choices"][0]["token_ids"]
        tally.ok()
