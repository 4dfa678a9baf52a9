"""Issue 30, finding 4: one tenant probing another's prompts through the prefix cache.

Two reference workers (``sim``, aggregated, KV events on) behind the proxy with the KV router.
Tenant A (key ``alice``) sends a 512-token prompt. Two other tenants then probe it, and a
prompt nobody sent: ``bob`` (a key of its own, not allowed to see ``cached_tokens``) and
``carol`` (tenant C, allowed to see it: only the cache's own isolation can hide A's prompt
from her). The attackers learn nothing when

- neither sees a cached token for A's prompt, nor any difference from the never-sent one;
- the KV router matched none of A's blocks for their probes (``x-pdproxy-route``: a probe is
  routed by load, never sent to A's holder because A's prompt is there);
- while A's own repeat still hits its cache (496/512), routed to the node holding it, and the
  keys of one tenant (carol, dave) share its cache: isolation costs a tenant nothing.

Before tenant isolation carol saw 496/512 cached tokens for A's prompt (0 for the never-sent
one), and the router sent her probe to A's holder (32 of 32 blocks matched).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from .procs import ProcessGroup
from .proxy_client import backend
from .record import Tally

pytestmark = pytest.mark.slow

_KEYS = {who: f"{who}-key-0123456789" for who in ("alice", "bob", "carol", "dave")}


def _prompt(seed: str) -> str:
    text = (f"{seed}: the confidential quarterly numbers are in this paragraph. " * 20)[:512]
    assert len(text) == 512  # sim tokenizes bytes: 512 tokens, 32 blocks of 16
    return text


async def _ask(client: httpx.AsyncClient, url: str, who: str, prompt: str) -> tuple[int, int]:
    """(cached tokens the caller was shown, blocks the router matched on its best consumer)."""
    resp = await client.post(
        f"{url}/v1/completions",
        json={"model": "kvtier-sim", "prompt": prompt, "max_tokens": 2, "temperature": 0},
        headers={"authorization": f"Bearer {_KEYS[who]}", "x-pdproxy-debug": "1"},
    )
    assert resp.status_code == 200, resp.text
    details = resp.json()["usage"].get("prompt_tokens_details") or {}
    explain: dict[str, Any] = json.loads(resp.headers["x-pdproxy-route"])
    matched = max((row["total"] for row in explain.get("consumers", [])), default=0)
    return int(details.get("cached_tokens") or 0), matched


async def test_tenant_cannot_probe_another_tenants_prompts(
    procs: ProcessGroup, tally: Tally
) -> None:
    workers = [procs.worker(name, role="both", events=True) for name in ("w0", "w1")]
    proxy = procs.proxy(
        "proxy",
        {
            "router": "kv",
            "router_options": {"model_seed": "kvtier-sim/seed=0", "block_size": 16},
            "backends": [
                {**backend(w.name, w.url, "both"), "events_endpoint": w.events_endpoint}
                for w in workers
            ],
            "api_keys": [
                {"key": _KEYS["alice"], "tenant": "A", "see_cached_tokens": True},
                {"key": _KEYS["bob"]},  # a tenant of its own
                {"key": _KEYS["carol"], "tenant": "C", "see_cached_tokens": True},
                {"key": _KEYS["dave"], "tenant": "C", "see_cached_tokens": True},
            ],
            "debug_headers": True,
            "health": {"enabled": False},
        },
    )
    secret = _prompt("Tenant A's secret")
    never_sent = {who: _prompt(f"{who.title()} never sent this") for who in ("bob", "carol")}
    async with httpx.AsyncClient(timeout=60) as client:
        first, _ = await _ask(client, proxy.url, "alice", secret)
        assert first == 0
        # A's own repeat: once the holder's events reached the router, it matches and hits.
        own = matched = 0
        for _ in range(50):
            await asyncio.sleep(0.1)
            own, matched = await _ask(client, proxy.url, "alice", secret)
            if matched:
                break
        assert (own, matched) == (496, 32), "tenant A's own prefix must stay cached and routed"
        tally.ok()

        seen = {}
        for who in ("bob", "carol"):
            seen[who, "A's prompt"] = await _ask(client, proxy.url, who, secret)
            seen[who, "never sent"] = await _ask(client, proxy.url, who, never_sent[who])
        tally.notes.append(f"cached tokens, blocks matched, seen by the probes: {seen}")
        for who in ("bob", "carol"):
            probe, control = seen[who, "A's prompt"], seen[who, "never sent"]
            assert probe[0] == control[0] == 0, f"{who} saw {probe[0]}/512 cached tokens"
            assert probe[1] == 0, f"the router matched {probe[1]} of A's blocks for {who}"
            tally.ok()
        # A tenant's keys share its cache: dave hits what carol sent, bob does not.
        assert (await _ask(client, proxy.url, "dave", never_sent["carol"]))[0] == 496
        assert (await _ask(client, proxy.url, "dave", never_sent["bob"]))[0] == 0
        tally.ok()
