"""Router configuration from the proxy's side: ``pdproxy serve --index``, and a backend's
``events_replay_endpoint`` feeding the KV router's event subscriptions."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from kvtier.events import EventPublisher
from kvtier.residency.types import NodeId
from pdproxy.cli import build_parser, main, settings_from_args
from pdproxy.errors import ConfigError
from pdproxy.routing.kv.build import EventEndpoints, build_kv_router
from pdproxy.routing.kv.router import KvRouter
from pdproxy.settings import ProxySettings
from pdproxy.settings.routing import KvRouterSettings
from tests.pdproxy.conftest import FakeFactory, ProxyFactory, backend_entry, quick_settings

from .kv_helpers import BS, HASHER, SEED, prompt_text, stored

DEAD_REPLAY = "tcp://127.0.0.1:1"
"""Nothing listens here: a subscription replaying from it would miss what was published."""

# -------------------------------------------------------------------------- serve --index


def serve_settings(*argv: str) -> ProxySettings:
    return settings_from_args(build_parser().parse_args(["serve", *argv]))


def test_index_sets_the_index_url_and_implies_the_kv_router() -> None:
    s = serve_settings("--index", "redis://127.0.0.1:6379/0")
    assert s.router == "kv"
    assert s.router_options.model_dump(exclude_unset=True) == {
        "index_url": "redis://127.0.0.1:6379/0"
    }
    assert serve_settings("--router", "kv", "--index", "rediss://h:1").router == "kv"
    plain = serve_settings()
    assert (
        plain.router == "round_robin" and "index_url" not in plain.router_options.model_fields_set
    )
    assert plain.router_options.index_url is None


def test_index_merges_into_the_config_files_router_options(tmp_path: Path) -> None:
    cfg = tmp_path / "proxy.yaml"
    cfg.write_text(
        "router: round_robin\n"
        "router_options:\n  model_seed: my-model\n  block_size: 32\n"
        "  index_url: redis://old:6379/0\n"
    )
    s = serve_settings("--config", str(cfg), "--index", "redis://new:6379/1")
    assert s.router == "kv"  # the flag is the highest-priority source
    assert s.router_options.model_dump(exclude_unset=True) == {
        "model_seed": "my-model",
        "block_size": 32,
        "index_url": "redis://new:6379/1",
    }


@pytest.mark.parametrize(
    "argv",
    [
        ("--router", "round_robin", "--index", "redis://h:1"),
        ("--router", "least_loaded", "--index", "redis://h:1"),
        ("--index", "http://h:6379"),
        ("--index", "h:6379"),
    ],
)
def test_index_refused_without_kv_router_or_redis_url(argv: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError, match="--index"):
        serve_settings(*argv)


def test_serve_with_a_bad_index_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--router", "least_loaded", "--index", "redis://h:1"]) == 2
    assert "--index needs the KV router" in capsys.readouterr().err


# -------------------------------------------------------------------------- replay endpoint


def test_backend_replay_endpoint_is_optional_and_kept() -> None:
    s = quick_settings(
        [
            {"name": "a", "url": "http://h:1", "role": "producer", "events_endpoint": "tcp://h:2",
             "events_replay_endpoint": "tcp://h:3"},
            {"name": "b", "url": "http://h:4", "role": "consumer"},
        ]
    )  # fmt: skip
    assert [b.events_replay_endpoint for b in s.backends] == ["tcp://h:3", None]


class Backends:
    def __init__(self, *backends: EventEndpoints) -> None:
        self.backends = list(backends)

    def all(self) -> list[EventEndpoints]:
        return list(self.backends)


async def test_build_prefers_the_backends_replay_endpoint() -> None:
    settings = KvRouterSettings(
        model_seed=SEED,
        block_size=BS,
        replay={"a": "tcp://configured:1", "b": "tcp://configured:2", "z": "tcp://configured:3"},
    )
    backends = Backends(
        EventEndpoints("a", "http://h:1", "tcp://h:5", "tcp://announced:1"),
        EventEndpoints("b", "http://h:2", "tcp://h:6", None),
    )
    router = build_kv_router(settings, backends=backends, metrics_registry=CollectorRegistry())
    try:
        assert router.settings.replay == {
            "a": "tcp://announced:1",
            "b": "tcp://configured:2",  # no replay of its own: the configured one stays
            "z": "tcp://configured:3",
        }
        assert settings.replay["a"] == "tcp://configured:1"  # the caller's settings untouched
    finally:
        await router.close()


async def held_blocks(router: KvRouter, node: str, text: str) -> int:
    m = (await router.state.index.match(HASHER.hash_tokens(list(text.encode())))).get(NodeId(node))
    return 0 if m is None else m.total


async def wait_for(router: KvRouter, node: str, text: str, blocks: int) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5
    while await held_blocks(router, node, text) < blocks:
        assert loop.time() < deadline, f"{node} never held {blocks} blocks"
        await asyncio.sleep(0.02)


async def test_events_missed_before_start_are_replayed_from_the_backends_endpoint(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    p0, c0 = await fake("p0"), await fake("c0")
    prefix = prompt_text(7)
    async with EventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*") as pub:
        assert pub.replay_endpoint is not None
        await pub.publish(stored(prefix))  # before anyone subscribes: only replay has it
        backends = [
            backend_entry(
                p0, "producer", "p2p",
                events_endpoint=pub.endpoint, events_replay_endpoint=pub.replay_endpoint,
            ),
            backend_entry(c0, "consumer", "p2p"),
        ]  # fmt: skip
        settings = quick_settings(
            backends,
            router="kv",
            router_options={"model_seed": SEED, "block_size": BS, "replay": {"p0": DEAD_REPLAY}},
        )
        running = await proxy(settings)
        router = running.state.router
        assert isinstance(router, KvRouter)
        await wait_for(router, "p0", prefix, 128)
        sub = router.feeds.subscriber("p0")
        assert sub is not None and sub.replay_endpoint == pub.replay_endpoint


async def test_backend_added_at_run_time_is_followed_with_its_replay_endpoint(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    p0, c0 = await fake("p0"), await fake("c0")
    prefix = prompt_text(8)
    async with EventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*") as pub:
        await pub.publish(stored(prefix))
        settings = quick_settings(
            [backend_entry(c0, "consumer", "p2p")],
            router="kv",
            router_options={"model_seed": SEED, "block_size": BS, "replay": {"p0": DEAD_REPLAY}},
            admin_key="admin-secret",
        )
        running = await proxy(settings)
        router = running.state.router
        assert isinstance(router, KvRouter)
        entry = backend_entry(
            p0, "producer", "p2p",
            events_endpoint=pub.endpoint, events_replay_endpoint=pub.replay_endpoint,
        )  # fmt: skip
        async with running.client() as client:
            resp = await client.post(
                "/admin/backends", json=entry, headers={"authorization": "Bearer admin-secret"}
            )
        assert resp.status_code == 201, resp.text
        await wait_for(router, "p0", prefix, 128)
        sub = router.feeds.subscriber("p0")
        assert sub is not None and sub.replay_endpoint == pub.replay_endpoint


async def test_configured_replay_still_serves_backends_without_their_own(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    """What ``pdproxy up`` writes today: replay endpoints in ``router_options.replay``."""
    p0, c0 = await fake("p0"), await fake("c0")
    prefix = prompt_text(9)
    async with EventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*") as pub:
        assert pub.replay_endpoint is not None
        await pub.publish(stored(prefix))
        backends = [
            backend_entry(p0, "producer", "p2p", events_endpoint=pub.endpoint),
            backend_entry(c0, "consumer", "p2p"),
        ]
        options = {
            "model_seed": SEED,
            "block_size": BS,
            "events": {"p0": pub.endpoint},
            "replay": {"p0": pub.replay_endpoint},
        }
        running = await proxy(quick_settings(backends, router="kv", router_options=options))
        router = running.state.router
        assert isinstance(router, KvRouter)
        await wait_for(router, "p0", prefix, 128)
        sub = router.feeds.subscriber("p0")
        assert sub is not None and sub.replay_endpoint == pub.replay_endpoint
