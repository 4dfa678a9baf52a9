"""The key schedule and the MACs, as properties: what one end seals, only the other end, in the
same order, under the same transcript and secret, accepts."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.errors import IntegrityError
from kvtier.p2p.sealing import (
    Opener,
    PageOpener,
    PageSealer,
    PageTag,
    Sealer,
    SessionSecrets,
    Transcript,
)

from .conftest import FINGERPRINT

TRANSCRIPT = Transcript(2, "producer", "consumer", FINGERPRINT, b"\x01" * 32, b"\x02" * 32)
messages_st = st.lists(st.binary(min_size=0, max_size=64), min_size=1, max_size=8)


def sealed(messages: list[bytes], key: bytes) -> list[tuple[bytes, bytes]]:
    sealer = Sealer(key)
    return [(m, sealer.tag(sealer.reserve(), m)) for m in messages]


@given(messages_st)
def test_in_order_frames_verify(messages: list[bytes]) -> None:
    keys = SessionSecrets.derive(b"secret", TRANSCRIPT)
    opener = Opener(keys.client_to_server)
    for message, tag in sealed(messages, keys.client_to_server):
        opener.verify(message, tag, "frame")


@given(messages_st, st.data())
def test_any_flipped_bit_is_refused(messages: list[bytes], data: st.DataObject) -> None:
    key = SessionSecrets.derive(b"secret", TRANSCRIPT).server_to_client
    frames = sealed(messages, key)
    victim = data.draw(st.integers(0, len(frames) - 1))
    message, tag = frames[victim]
    blob = bytearray(message + tag)
    bit = data.draw(st.integers(0, len(blob) * 8 - 1))
    blob[bit // 8] ^= 1 << (bit % 8)
    frames[victim] = (bytes(blob[: len(message)]), bytes(blob[len(message) :]))
    opener = Opener(key)
    for i, (m, t) in enumerate(frames):
        if i == victim:
            with pytest.raises(IntegrityError):
                opener.verify(m, t, "frame")
            return
        opener.verify(m, t, "frame")


@given(messages_st.filter(lambda ms: len(ms) >= 2), st.data())
def test_replayed_or_reordered_frames_are_refused(
    messages: list[bytes], data: st.DataObject
) -> None:
    key = SessionSecrets.derive(None, TRANSCRIPT).client_to_server
    frames = sealed(messages, key)
    order = data.draw(st.lists(st.integers(0, len(frames) - 1), min_size=1, max_size=10))
    opener = Opener(key)
    for position, index in enumerate(order):
        if index != position:  # a frame anywhere but at its own sequence number
            with pytest.raises(IntegrityError):
                opener.verify(*frames[index], "frame")
            return
        opener.verify(*frames[index], "frame")


def test_directions_and_roles_are_separated() -> None:
    keys = SessionSecrets.derive(b"secret", TRANSCRIPT)
    outputs = {keys.client_proof, keys.server_proof, keys.client_to_server, keys.server_to_client}
    assert len(outputs) == 4  # no reflection between proofs or between directions
    message = b"fetch"
    sealer = Sealer(keys.server_to_client)
    tag = sealer.tag(sealer.reserve(), message)
    with pytest.raises(IntegrityError):  # a producer frame sent back to the producer
        Opener(keys.client_to_server).verify(message, tag, "frame")


@pytest.mark.parametrize(
    "change",
    [
        {"version": 3},
        {"server_node_id": "producer-b"},
        {"client_node_id": "consumer-b"},
        {"fingerprint": dataclasses.replace(FINGERPRINT, dtype="bfloat16")},
        {"server_nonce": b"\x03" * 32},
        {"client_nonce": b"\x04" * 32},
    ],
)
def test_every_transcript_field_changes_every_output(change: dict[str, object]) -> None:
    base = SessionSecrets.derive(b"secret", TRANSCRIPT)
    other = SessionSecrets.derive(b"secret", dataclasses.replace(TRANSCRIPT, **change))  # type: ignore[arg-type]
    for field in dataclasses.fields(SessionSecrets):
        assert getattr(base, field.name) != getattr(other, field.name), field.name


def test_the_secret_changes_every_output() -> None:
    with_secret = SessionSecrets.derive(b"secret", TRANSCRIPT)
    for other in (
        SessionSecrets.derive(b"secreT", TRANSCRIPT),
        SessionSecrets.derive(None, TRANSCRIPT),
    ):
        for field in dataclasses.fields(SessionSecrets):
            assert getattr(with_secret, field.name) != getattr(other, field.name)


@given(st.binary(min_size=1, max_size=256), st.data())
def test_page_tags_refuse_any_flipped_bit_or_other_nonce(page: bytes, data: st.DataObject) -> None:
    sealer = PageSealer()
    tag = sealer.tag(page)
    opener = PageOpener(sealer.key)
    opener.verify(page, tag, "page")
    bit = data.draw(st.integers(0, len(page) * 8 - 1))
    flipped = bytearray(page)
    flipped[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(IntegrityError):
        opener.verify(flipped, tag, "page")
    with pytest.raises(IntegrityError):
        opener.verify(page, PageTag(tag.nonce + 1, tag.mac), "page")
    with pytest.raises(IntegrityError):
        PageOpener(PageSealer().key).verify(page, tag, "page")  # another producer's key


def test_page_tags_never_reuse_a_nonce() -> None:
    sealer = PageSealer()
    nonces = {sealer.tag(b"same page").nonce for _ in range(100)}
    assert len(nonces) == 100


def test_page_key_unwraps_only_in_its_own_session() -> None:
    """The page key travels in welcome: only this session's keys open it; another session's
    (a relay that ran its own handshake) and any changed byte fail."""
    page_key = PageSealer().key
    mine = SessionSecrets.derive(b"secret", TRANSCRIPT)
    wrapped = mine.wrap_page_key(page_key)
    assert page_key not in wrapped  # encrypted, not only authenticated
    assert mine.unwrap_page_key(wrapped) == page_key
    other = SessionSecrets.derive(
        b"secret", dataclasses.replace(TRANSCRIPT, client_nonce=b"\x03" * 32)
    )
    with pytest.raises(IntegrityError):
        other.unwrap_page_key(wrapped)
    with pytest.raises(IntegrityError):
        SessionSecrets.derive(b"guess", TRANSCRIPT).unwrap_page_key(wrapped)
    tampered = bytearray(wrapped)
    tampered[0] ^= 1
    with pytest.raises(IntegrityError):
        mine.unwrap_page_key(bytes(tampered))
