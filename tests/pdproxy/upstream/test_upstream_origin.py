"""Backend URLs: one split for every call (prefixes, IPv6, refusals), and legs sent only once."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from pdproxy.errors import LegFailed
from pdproxy.fleet.backends import Backend, BackendRegistry
from pdproxy.fleet.health import HealthChecker
from pdproxy.fleet.models import aggregate_models
from pdproxy.origin import Origin, base_prefix, split_url
from pdproxy.routing.base import Role
from pdproxy.settings import (
    BackendConfig,
    BreakerSettings,
    HealthSettings,
    TimeoutSettings,
    UpstreamSettings,
)
from pdproxy.upstream.client import Upstream
from tests.pdproxy.raw_upstream import answer, raw_server


def test_split_url_examples() -> None:
    assert split_url("http://Engine-1:8100/v1/x?a=1") == (
        Origin(False, "engine-1", 8100, "engine-1:8100"),
        "/v1/x?a=1",
    )
    assert split_url("https://gw/") == (Origin(True, "gw", 443, "gw"), "/")
    assert split_url("http://gw:80") == (Origin(False, "gw", 80, "gw"), "/")
    origin, target = split_url("http://[::1]:8100/p/health")
    assert origin == Origin(False, "::1", 8100, "[::1]:8100") and target == "/p/health"
    assert split_url("http://[2001:db8::5]/")[0].host_header == "[2001:db8::5]"
    assert split_url("http://[::1]:9/")[0].display == "[::1]:9"


@pytest.mark.parametrize(
    "url",
    [
        "ftp://h/",
        "http://",
        "http://user:pw@h:1/",
        "http://h:1/#frag",
        "http://h:99999/",
        "http://h:port/",
        "http://[::1/",
    ],
)
def test_unusable_urls_are_refused(url: str) -> None:
    with pytest.raises(ValueError):
        split_url(url)


def test_backend_config_refuses_what_the_client_cannot_use() -> None:
    def config(url: str, health_path: str = "/health") -> BackendConfig:
        return BackendConfig(name="b", url=url, role=Role.CONSUMER, health_path=health_path)

    assert config("http://h:1/prefix/").url == "http://h:1/prefix"
    for bad in ("http://h:1/?x=1", "http://u@h:1/", "http://h:1/#f", "http://h:x/"):
        with pytest.raises(ValidationError):
            config(bad)
    with pytest.raises(ValidationError):
        config("http://h:1", health_path="health")


_segments = st.text(alphabet="abcxyz09-._~", min_size=1, max_size=8)


@given(
    host=st.sampled_from(["h", "10.0.0.7", "[::1]", "[fd00::2]", "engine.local"]),
    port=st.one_of(st.none(), st.integers(1, 65535)),
    prefix=st.lists(_segments, max_size=3),
    path=st.lists(_segments, min_size=1, max_size=4),
)
def test_a_prefix_is_kept_the_same_way_for_legs_and_for_full_urls(
    host: str, port: int | None, prefix: list[str], path: list[str]
) -> None:
    base = f"http://{host}" + (f":{port}" if port else "") + "".join(f"/{p}" for p in prefix)
    leg_path = "".join(f"/{p}" for p in path)
    origin, base_path = base_prefix(base)
    # What a leg sends (prefix + path) is what a full-URL call (health, release) sends.
    assert split_url(base + leg_path) == (origin, base_path + leg_path)
    assert origin.host_header.startswith(host)


def _backend(url: str) -> Backend:
    return BackendRegistry(BreakerSettings()).add(BackendConfig(name="b", url=url, role=Role.BOTH))


async def test_legs_health_models_and_releases_all_keep_the_prefix() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await srv.read_request(reader)
            writer.write(answer(b'{"data": [{"id": "m"}]}'))
            await writer.drain()

    async with raw_server(handler) as srv:
        registry = BackendRegistry(BreakerSettings())
        backend = registry.add(BackendConfig(name="b", url=srv.url + "/engine-3/", role=Role.BOTH))
        upstream = Upstream(TimeoutSettings(), UpstreamSettings())
        await upstream.producer_leg(backend, "/v1/completions", b"{}", {})
        opened = await upstream.open_consumer_leg(
            backend, "/v1/chat/completions", b"{}", {}, stream=False
        )
        assert opened.complete
        await HealthChecker(HealthSettings(), registry, upstream).check(backend)
        assert backend.health_failures == 0
        models = await aggregate_models(registry, upstream)
        assert [m["id"] for m in models["data"]] == ["m"]
        await upstream.post_json(backend.url + "/v1/kv/release", b"{}", {})
        await upstream.close()
    targets = [r.split(b" ")[1] for r in srv.requests]
    assert targets == [
        b"/engine-3/v1/completions",
        b"/engine-3/v1/chat/completions",
        b"/engine-3/health",
        b"/engine-3/v1/models",
        b"/engine-3/v1/kv/release",
    ]
    assert srv.connections == 1  # one pool per origin, however the URL was spelled


async def test_a_producer_leg_runs_once_when_the_upstream_hangs_up_after_reading_it() -> None:
    """The prefill must never run twice: a kept-alive connection closed after the read."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            _, body = await srv.read_request(reader)
            if body == b"prefill":
                writer.transport.abort()
                return
            writer.write(answer(b"{}"))
            await writer.drain()

    async with raw_server(handler) as srv:
        backend = _backend(srv.url)
        upstream = Upstream(TimeoutSettings(), UpstreamSettings())
        await upstream.producer_leg(backend, "/v1/completions", b"warm-up", {})
        with pytest.raises(LegFailed, match="closed early"):
            await upstream.producer_leg(backend, "/v1/completions", b"prefill", {})
        await upstream.close()
    assert [r.endswith(b"prefill") for r in srv.requests] == [False, True]
