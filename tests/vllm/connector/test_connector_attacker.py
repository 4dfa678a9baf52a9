"""The P2P port of a real vLLM running kvtier's connector, played by an attacker: a stranger
without the secret, one with a wrong secret, and one with the secret guessing a kv_request_id
get no page; the legitimate fetch of the same supply gets every page. The same for
``remote_kv_source`` offers: strangers learn nothing."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from kvtier.keys import BlockHasher, OffloadKey, offload_key
from kvtier.offload.buffer import BytearrayPageBuffer
from kvtier.offload.pool import HostPagePool
from kvtier.p2p import LayoutFingerprint, LocalIdentity, P2PClient, P2PSettings, PoolSink
from kvtier.p2p.client import FetchResult
from kvtier.p2p.frames import PeerNodeId
from kvtier.p2p.offer import OfferResult
from kvtier.vllm.offers import NoPages
from pdproxy.stack.vllm_engine import SERVED_NAME, VLLM_BLOCK_SIZE
from tests.vllm.conftest import prompt_ids
from tests.vllm.connector.conftest import PAGE_BYTES, KvtierStack, complete

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

FINGERPRINT = LayoutFingerprint(
    f"vllm/{SERVED_NAME}", VLLM_BLOCK_SIZE, "torch.bfloat16", (PAGE_BYTES,)
)


def _fetch(
    port: int, secret: bytes | None, kv_request_id: str, keys: list[OffloadKey], engine_id: str
) -> FetchResult:
    async def run() -> FetchResult:
        identity = LocalIdentity(PeerNodeId("attacker"), FINGERPRINT, secret)
        pool = HostPagePool(BytearrayPageBuffer(len(keys) + 1, PAGE_BYTES))
        client = P2PClient(P2PSettings(fetch_timeout_s=5.0), identity, PoolSink(pool))
        try:
            return await client.fetch(
                "127.0.0.1", port, kv_request_id, keys, expected_node_id=engine_id
            )
        finally:
            await client.close()

    return asyncio.run(run())


def test_p2p_port_serves_only_secret_holders_with_the_id(kvtier_stack: KvtierStack) -> None:
    stack = kvtier_stack
    prompt = prompt_ids(140, 3 * VLLM_BLOCK_SIZE + 5)
    kv_request_id = uuid.uuid4().hex
    produced = complete(
        stack.url("p1"),
        prompt,
        max_tokens=1,
        kv_transfer_params={"remote_decoder": {"kv_request_id": kv_request_id}},
    )["kv_transfer_params"]
    port, engine_id = produced["remote_port"], produced["remote_engine_id"]
    assert port == stack.instances["p1"].p2p_port
    hashes = BlockHasher(f"vllm/{SERVED_NAME}", VLLM_BLOCK_SIZE).hash_tokens(prompt)
    keys = [offload_key(h, 0) for h in hashes]
    secret = stack.p2p_secret.encode()

    # Refused in the handshake: no page, and never far enough to learn whether the id exists.
    for attacker_secret in (None, b"not-the-secret"):
        refused = _fetch(port, attacker_secret, kv_request_id, keys, engine_id)
        assert refused.fetched == () and refused.usable == 0
        assert refused.reason is not None and "kv_request_id" not in refused.reason
    guessed = _fetch(port, secret, uuid.uuid4().hex, keys, engine_id)
    assert guessed.fetched == () and "unknown kv_request_id" in (guessed.reason or "")

    # The supply was untouched by all that: the holder of the secret and the id gets it all.
    legit = _fetch(port, secret, kv_request_id, keys, engine_id)
    assert legit.complete and len(legit.fetched) == 3
    assert legit.nbytes == 3 * PAGE_BYTES


def _offer(port: int, secret: bytes | None, keys: list[OffloadKey], engine_id: str) -> OfferResult:
    async def run() -> OfferResult:
        identity = LocalIdentity(PeerNodeId("attacker"), FINGERPRINT, secret)
        client = P2PClient(P2PSettings(fetch_timeout_s=5.0), identity, NoPages())
        try:
            offered = await client.offer("127.0.0.1", port, keys, expected_node_id=engine_id)
            if offered.kv_request_id is not None:  # what a puller does after fetching: done
                await client.release("127.0.0.1", port, offered.kv_request_id)
            return offered
        finally:
            await client.close()

    return asyncio.run(run())


def test_offers_answer_only_secret_holders(kvtier_stack: KvtierStack) -> None:
    """``remote_kv_source`` offers on the same port: without the secret nothing is revealed
    (the handshake refuses before any key is read); with it, the holder pins what it holds —
    the membership oracle the secret grants by design (docs in ``kvtier.p2p.offer``)."""
    stack = kvtier_stack
    prompt = prompt_ids(141, 3 * VLLM_BLOCK_SIZE + 5)
    kv_request_id = uuid.uuid4().hex
    produced = complete(
        stack.url("p1"),
        prompt,
        max_tokens=1,
        kv_transfer_params={"remote_decoder": {"kv_request_id": kv_request_id}},
    )["kv_transfer_params"]
    port, engine_id = produced["remote_port"], produced["remote_engine_id"]
    hashes = BlockHasher(f"vllm/{SERVED_NAME}", VLLM_BLOCK_SIZE).hash_tokens(prompt)
    keys = [offload_key(h, 0) for h in hashes]
    for attacker_secret in (None, b"not-the-secret"):
        refused = _offer(port, attacker_secret, keys, engine_id)
        assert refused.kv_request_id is None and refused.num_held == 0
        assert "handshake refused" in (refused.reason or "")
    secret = stack.p2p_secret.encode()
    offered = _offer(port, secret, keys, engine_id)
    assert offered.kv_request_id is not None and offered.num_held == 3
    # The producer leg's own supply is intact (and its done releases it: later tests count).
    assert _fetch(port, secret, kv_request_id, keys, engine_id).complete
