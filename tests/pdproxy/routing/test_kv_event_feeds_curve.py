"""The router's KV event subscriptions under ZMQ CURVE: keyed feeds fill the index, unkeyed ones
learn nothing, a backend without a configured server key is not followed in plain text."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from kvtier.events import EventPublisher
from pdproxy.errors import ConfigError
from pdproxy.routing.kv.build import build_kv_router
from pdproxy.settings.routing import EventsCurveSettings, KvRouterSettings
from tests.kvtier.events.conftest import write_curve_files

from .kv_helpers import BS, SEED, prompt_text, stored
from .test_kv_event_feeds import _has, held, publish_until


async def test_keyed_router_follows_a_curve_publisher_and_an_unkeyed_one_learns_nothing(
    tmp_path: Path,
) -> None:
    files = write_curve_files(tmp_path / "curve")
    text = prompt_text(7)
    async with EventPublisher(
        "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", curve=files.server()
    ) as pub:
        assert pub.replay_endpoint is not None
        events, replay = {"p0": pub.endpoint}, {"p0": pub.replay_endpoint}
        keyed = build_kv_router(
            KvRouterSettings(
                model_seed=SEED, block_size=BS, events=events, replay=replay,
                events_curve=EventsCurveSettings(
                    client_secret_key_file=files.client_secret,
                    server_public_key_file=files.server_public,
                ),
            ),
            metrics_registry=CollectorRegistry(),
        )  # fmt: skip
        unkeyed = build_kv_router(
            KvRouterSettings(model_seed=SEED, block_size=BS, events=events, replay=replay),
            metrics_registry=CollectorRegistry(),
        )
        await keyed.start()
        await unkeyed.start()
        try:
            await publish_until(pub, stored(text), lambda: _has(keyed, "p0", text))
            assert await held(unkeyed, "p0", text) == 0
            sub = unkeyed.feeds.subscriber("p0")
            assert sub is not None and sub.stats.received == 0 and sub.stats.replayed == 0
        finally:
            await keyed.close()
            await unkeyed.close()


async def test_a_backend_without_a_server_key_is_not_followed(tmp_path: Path) -> None:
    files = write_curve_files(tmp_path / "curve")
    settings = KvRouterSettings(
        model_seed=SEED,
        block_size=BS,
        events={"p0": "tcp://127.0.0.1:9", "p1": "tcp://127.0.0.1:10"},
        events_curve=EventsCurveSettings(
            client_secret_key_file=files.client_secret,
            server_public_key_files={"p0": files.server_public},
        ),
    )
    router = build_kv_router(settings, metrics_registry=CollectorRegistry())
    await router.start()
    try:
        assert router.feeds.nodes == ["p0"]
    finally:
        await router.close()


def test_unreadable_key_files_fail_at_build_naming_the_file(tmp_path: Path) -> None:
    files = write_curve_files(tmp_path / "curve")
    missing = tmp_path / "nope.key"
    settings = KvRouterSettings(
        events_curve=EventsCurveSettings(
            client_secret_key_file=files.client_secret, server_public_key_file=missing
        )
    )
    with pytest.raises(ConfigError, match=r"nope\.key"):
        build_kv_router(settings, metrics_registry=CollectorRegistry())
