"""CURVE on the KV event sockets, played by an eavesdropper: events carry prompt token ids.

Every negative test runs an admitted subscriber beside the attacker, so "received nothing" is
measured while the same publisher is demonstrably delivering.
"""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from kvtier.errors import EventSecurityError
from kvtier.events import BlockStored, EventBatch, EventPublisher, EventSubscriber
from kvtier.events.curve import (
    CurveClient,
    load_client,
    load_server,
    main,
    write_certificate,
)
from kvtier.events.publisher import seq_frame

from .conftest import CurveFiles

SECRET_PROMPT = tuple(range(1000, 1016))  # token ids of a confidential prompt


def stored(i: int) -> EventBatch:
    return EventBatch(ts=float(i), events=(BlockStored((i,), None, SECRET_PROMPT, 16),))


class Tap:
    """What a subscriber received."""

    def __init__(self) -> None:
        self.batches: list[EventBatch] = []

    async def on_batch(self, batch: EventBatch) -> None:
        self.batches.append(batch)


async def _publish_until(pub: EventPublisher, tap: Tap, count: int) -> None:
    """Publish until the admitted subscriber holds ``count`` batches (bounded)."""
    async with asyncio.timeout(10):
        i = 0
        while len(tap.batches) < count:
            await pub.publish(stored(i))
            i += 1
            await asyncio.sleep(0.01)


async def _eavesdrop(pub: EventPublisher, curve: CurveClient | None, files: CurveFiles) -> Tap:
    """An attacker's subscriber (``curve``: its keys, or None) beside an admitted one."""
    admitted, attacker = Tap(), Tap()
    assert pub.replay_endpoint is not None
    async with (
        EventSubscriber(
            pub.endpoint, pub.replay_endpoint, on_batch=admitted.on_batch, curve=files.client()
        ),
        EventSubscriber(
            pub.endpoint,
            pub.replay_endpoint,
            on_batch=attacker.on_batch,
            curve=curve,
            replay_timeout_s=0.3,
        ) as spy,
    ):
        await _publish_until(pub, admitted, 20)
        await asyncio.sleep(0.2)  # time for any late delivery to the attacker
        assert spy.stats.received == 0 and spy.stats.replayed == 0
    assert len(admitted.batches) >= 20
    assert admitted.batches[0].events[0].token_ids == SECRET_PROMPT  # type: ignore[union-attr]
    return attacker


async def test_a_subscriber_without_keys_receives_nothing(curve_files: CurveFiles) -> None:
    async with EventPublisher(
        "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", curve=curve_files.server()
    ) as pub:
        for i in range(5):  # already in the replay buffer when the attacker asks
            await pub.publish(stored(i))
        attacker = await _eavesdrop(pub, None, curve_files)
        assert attacker.batches == []


async def test_an_unadmitted_key_pair_receives_nothing(
    curve_files: CurveFiles, tmp_path: Path
) -> None:
    """The attacker knows the worker's public key (it is public) but holds its own pair."""
    _, own_secret = write_certificate(tmp_path / "attacker", "attacker")
    spy_keys = load_client(own_secret, curve_files.server_public)
    async with EventPublisher(
        "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", curve=curve_files.server()
    ) as pub:
        attacker = await _eavesdrop(pub, spy_keys, curve_files)
        assert attacker.batches == []
        assert pub.refused_clients >= 1


async def test_a_subscriber_expecting_another_server_receives_nothing(
    curve_files: CurveFiles, tmp_path: Path
) -> None:
    """An admitted client pair but the wrong server key: the handshake fails both ways."""
    other_public, _ = write_certificate(tmp_path / "other", "other")
    wrong = load_client(curve_files.client_secret, other_public)
    async with EventPublisher(
        "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", curve=curve_files.server()
    ) as pub:
        attacker = await _eavesdrop(pub, wrong, curve_files)
        assert attacker.batches == []


async def test_a_raw_replay_request_without_keys_gets_no_answer(curve_files: CurveFiles) -> None:
    async with EventPublisher(
        "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", curve=curve_files.server()
    ) as pub:
        for i in range(5):
            await pub.publish(stored(i))
        assert pub.replay_endpoint is not None
        ctx = zmq.asyncio.Context()
        dealer = ctx.socket(zmq.DEALER)
        try:
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(pub.replay_endpoint)
            await dealer.send_multipart((b"", seq_frame(0)))
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.5):
                    await dealer.recv_multipart()
        finally:
            dealer.close(linger=0)
            ctx.term()
        assert pub.replays_served == 0


def test_key_files_secret_is_0600_and_errors_name_the_file_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = os.umask(0)
    try:
        assert main([str(tmp_path / "keys"), "worker"]) == 0
    finally:
        os.umask(old)
    public, secret = tmp_path / "keys" / "worker.key", tmp_path / "keys" / "worker.key_secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    secret_key = secret.read_text().split('secret-key = "')[1][:40]
    assert secret_key not in capsys.readouterr().out
    assert "secret-key" not in public.read_text()
    with pytest.raises(EventSecurityError, match="holds no secret key") as caught:
        load_client(public, public)  # a public certificate where the secret one belongs
    assert secret_key not in str(caught.value)
    garbled = tmp_path / "garbled.key_secret"
    garbled.write_text(f'public-key = "short"\nsecret-key = "{secret_key}"\n')
    with pytest.raises(EventSecurityError) as caught:
        load_client(garbled, public)
    assert secret_key not in str(caught.value) and "garbled" in str(caught.value)
    with pytest.raises(EventSecurityError, match="does not exist"):
        load_server(secret, tmp_path / "keys" / "missing-dir")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(EventSecurityError, match="no client public certificate"):
        load_server(secret, empty)
    assert repr(load_client(secret, public)).count(secret_key) == 0
