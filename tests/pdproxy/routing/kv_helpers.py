"""Shared pieces of the KV router tests: backends as the router sees them, events, requests."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.events import BlockRemoved, BlockStored, EventBatch
from kvtier.keys import BlockHasher
from pdproxy.routing.base import Role, RouteRequest
from pdproxy.routing.kv.decide import Scoring, pick
from pdproxy.routing.kv.plan import NodeState, Plan, PromptShape
from pdproxy.routing.kv.scorers.load import LoadView
from pdproxy.routing.kv.scorers.prefix import PrefixView
from pdproxy.settings.routing import KvRouterSettings

SEED = "test-model"
BS = 16
HASHER = BlockHasher(SEED, BS)


@dataclass
class Backend:
    """A backend as the registry shows it to routers (BackendView)."""

    name: str
    role: Role
    url: str = "http://127.0.0.1:9"
    routable: bool = True
    in_flight: int = 0


def pool(producers: int, consumers: int) -> tuple[list[Backend], list[Backend]]:
    return (
        [Backend(f"p{i}", Role.PRODUCER) for i in range(producers)],
        [Backend(f"c{i}", Role.CONSUMER) for i in range(consumers)],
    )


def text_request(text: str, rid: str | None = None) -> RouteRequest:
    """A completion request; request ids are unique per request in flight (the router keys
    what it charged by them), so each gets a fresh one unless given."""
    return RouteRequest(rid or uuid.uuid4().hex, "completions", {"model": "m", "prompt": text})


def stored(text: str, medium: str = "GPU", seed: str = SEED) -> EventBatch:
    """The event a byte-tokenizing engine publishes after caching ``text``'s full blocks."""
    tokens = list(text.encode())
    tokens = tokens[: len(tokens) // BS * BS]
    hashes = (HASHER if seed == SEED else BlockHasher(seed, BS)).hash_tokens(tokens)
    return EventBatch(0.0, (BlockStored(tuple(hashes), None, tuple(tokens), BS, None, medium),))


def removed(text: str, medium: str = "GPU", first_block: int = 0) -> EventBatch:
    tokens = list(text.encode())
    hashes: Sequence[bytes] = HASHER.hash_tokens(tokens[: len(tokens) // BS * BS])
    return EventBatch(0.0, (BlockRemoved(tuple(hashes[first_block:]), medium),))


def prompt_text(group: int, length: int = 2048, suffix: str = "") -> str:
    """A ``length``-byte shared prefix for ``group`` plus a per-request suffix."""
    unit = f"[{group:04d}] system prompt of this group. "  # differs from the first block on
    return (unit * (length // len(unit) + 1))[:length] + suffix


def scoring(
    prompt: PromptShape | None,
    producers: Sequence[NodeState],
    consumers: Sequence[NodeState],
    settings: KvRouterSettings,
) -> Scoring:
    """Candidates scored by the cost terms that need no outside signal: load, prefix credit."""
    views = (LoadView(settings.weights), PrefixView(settings.weights))
    return Scoring(prompt, producers, consumers, views, settings.block_size)


def plan_route(
    prompt: PromptShape | None,
    producers: Sequence[NodeState],
    consumers: Sequence[NodeState],
    settings: KvRouterSettings,
) -> Plan:
    """The picker's plan over constructed candidates (``prompt`` None: load alone)."""
    return pick(scoring(prompt, producers, consumers, settings), settings)
