"""Drives :class:`kvtier.vllm.scheduler.KvtierScheduler` as vLLM's scheduler does, in vLLM's venv
(the scheduler's metadata subclasses vLLM's): ``python -m tests.kvtier.vllm.scheduler_driver``
reads a JSON list of cases on stdin and prints, per case, what the scheduler answered and which
peers the step's loads and releases name. :mod:`.test_scheduler_peers` runs it.

A case: ``{"id", "params" (kv_transfer_params), "extra" (kv_connector_extra_config), "abort"
(finish the request before its blocks are allocated)}``.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from typing import Any

from kvtier.vllm.scheduler import KvtierScheduler
from kvtier.vllm.settings import KvtierConnectorSettings

BLOCK = 4


@dataclass
class _Request:
    """What the scheduler reads of vLLM's ``Request``."""

    request_id: str
    kv_transfer_params: dict[str, Any] | None
    prompt_token_ids: list[int] = field(default_factory=lambda: list(range(4 * BLOCK + 1)))
    cache_salt: str | None = None
    num_computed_tokens: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class _Blocks:
    ids: list[int]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.ids,)


class _KvCacheManager:
    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return (list(range(8)),)


@dataclass
class _SchedulerOutput:
    num_scheduled_tokens: dict[str, int]


def run(case: dict[str, Any]) -> dict[str, Any]:
    sched = KvtierScheduler(
        KvtierConnectorSettings.from_extra_config(case.get("extra", {})),
        engine_id="consumer-engine",
        block_size=BLOCK,
        hash_seed="peers-test",
        produces=True,
        consumes=True,
    )
    manager: Any = _KvCacheManager()
    sched.bind(manager)
    request: Any = _Request(case["id"], case["params"])
    sched.on_new_request(request)
    count, is_async = sched.get_num_new_matched_tokens(request, 0)
    if case.get("abort"):
        sched.request_finished(request, [])
    else:
        blocks: Any = _Blocks(list(range(8)))
        sched.update_state_after_alloc(request, blocks, count or 0)
    output: Any = _SchedulerOutput({case["id"]: request.num_prompt_tokens})
    meta = sched.build_connector_meta(output)
    return {
        "matched": [count, is_async],
        "peers": sorted(
            {f"{s.remote_host}:{s.remote_port}" for s in (*meta.loads, *meta.releases)}
        ),
        "saves": [s.kv_request_id for s in meta.saves],
    }


def main() -> None:
    print(json.dumps([run(case) for case in json.load(sys.stdin)]))


if __name__ == "__main__":
    main()
