"""Routing accuracy on real vLLM: the router's predicted cached tokens beside what each engine
reports, on a multi-turn workload over two NIXL producers (p0 of the shared stack and p1,
started for this module) and the consumer d0.

Every turn adds a user message longer than ``local_prefill.max_suffix_tokens``, so every
request is disaggregated and both legs are checked: the producer's answer's ``cached_tokens``
against what the router predicted it holds (from its KV events), the consumer's against its
own prefix (``pd_cached_tokens: consumer_local``). Three conversations, turns interleaved:
round robin over two producers would not keep a conversation on one producer, the KV router
does, and each producer answers every later turn from its prefix cache (a NIXL producer keeps a
prefill's blocks cached after the consumer read them: BlockStored, no BlockRemoved).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest

from pdproxy.stack.process import ProcessSpec
from pdproxy.stack.supervisor import Supervisor
from pdproxy.stack.vllm_engine import VLLM_BLOCK_SIZE, VllmRole, proxy_backend, vllm_instance
from pdproxy.stack.vllm_plan import proxy_config
from tests.conftest import free_port
from tests.vllm.conftest import (
    MODEL,
    ROOT,
    STARTUP_TIMEOUT_S,
    VllmStack,
    _write_proxy,
    prompt_ids,
    route_of,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200)]

CONVERSATIONS = 3
TURNS = 3
USER_TOKENS = 300
"""Past ``max_suffix_tokens`` (256): every turn needs a producer."""
ANSWER_TOKENS = 8
HANDSHAKE_TRIES = 3


@dataclass(frozen=True, slots=True)
class TwoProducers:
    url: str
    """Proxy: producers p0 and p1, consumer d0, KV router with vLLM's defaults."""
    stack: VllmStack
    p1_url: str


def _nixl_handshake(producer: str, consumer: str) -> None:
    """One PD request by hand until the consumer's first NIXL handshake with this producer
    succeeded (on two shared cores it can time out once: see ``_first_pd_request``)."""
    prompt = prompt_ids(900, 200)
    failures = []
    for _ in range(HANDSHAKE_TRIES):
        leg = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0,
               "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                                      "remote_engine_id": None, "remote_block_ids": None,
                                      "remote_host": None, "remote_port": None}}  # fmt: skip
        answer = httpx.post(producer + "/v1/completions", json=leg, timeout=STARTUP_TIMEOUT_S)
        assert answer.status_code == 200, answer.text
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0,
                "kv_transfer_params": answer.json()["kv_transfer_params"]}  # fmt: skip
        resp = httpx.post(consumer + "/v1/completions", json=body, timeout=STARTUP_TIMEOUT_S)
        if resp.status_code == 200:
            return
        failures.append(f"{resp.status_code} {resp.text[:200]}")
    pytest.fail(f"no NIXL transfer from p1 to d0 in {HANDSHAKE_TRIES} tries: {failures}")


@pytest.fixture(scope="module")
def two_producers(
    vllm_stack: VllmStack, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TwoProducers]:
    run_dir = tmp_path_factory.mktemp("vllm-p1")
    sockets = run_dir / "sockets"
    sockets.mkdir(mode=0o700)
    p1 = vllm_instance(
        "p1", VllmRole.PRODUCER, vllm_stack.paths, http_port=free_port(),
        side_channel_port=free_port(), socket_dir=sockets,
    )  # fmt: skip
    with Supervisor(run_dir / "logs", stop_grace_s=15.0) as supervisor:
        supervisor.start([p1.spec])
        supervisor.wait_healthy(STARTUP_TIMEOUT_S)
        _nixl_handshake(p1.url, vllm_stack.url("d0"))
        backends = [
            proxy_backend(vllm_stack.instances["p0"]),
            proxy_backend(p1),
            proxy_backend(vllm_stack.instances["d0"]),
        ]
        config = proxy_config(backends, vllm_stack.paths, host="127.0.0.1", port=0)
        # The thresholds disaggregate every turn; a warm TTFT model must not bypass them.
        config["router_options"]["ttft"] = {"bypass": False}
        url, argv = _write_proxy(run_dir, "pd2", config)
        env = {"PYTHONPATH": str(ROOT)}
        supervisor.start([ProcessSpec("pd2-proxy", tuple(argv), url + "/ready", env, "proxy")])
        supervisor.wait_healthy(60.0)
        yield TwoProducers(url, vllm_stack, p1.url)


_CHECK = re.compile(
    r'^pdproxy_kv_router_prediction_checks_total\{leg="(\w+)",result="(\w+)"\} (\S+)$', re.M
)


def _checks(url: str) -> dict[tuple[str, str], float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {(m[1], m[2]): float(m[3]) for m in _CHECK.finditer(text)}


@dataclass(frozen=True, slots=True)
class _Turn:
    conversation: int
    turn: int
    producer: str
    predicted_producer: int
    predicted_consumer: int
    consumer_cached: int


def _send(url: str, prompt: list[int]) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": ANSWER_TOKENS, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    resp = httpx.post(
        url + "/v1/completions", json=body, headers={"x-pdproxy-debug": "1"}, timeout=300
    )
    assert resp.status_code == 200, resp.text
    return resp


def test_predictions_match_what_vllm_reports_on_a_multi_turn_workload(
    two_producers: TwoProducers,
) -> None:
    url = two_producers.url
    before = _checks(url)
    prompts = {c: prompt_ids(1000 + c, USER_TOKENS) for c in range(CONVERSATIONS)}
    turns: list[_Turn] = []
    for turn in range(TURNS):
        if turn == 0:
            # The first turns at once: the router spreads them over both producers by load.
            with ThreadPoolExecutor(CONVERSATIONS) as pool:
                answers = list(pool.map(lambda c: _send(url, prompts[c]), range(CONVERSATIONS)))
        else:  # one at a time: each goes where its prefix is, not where the load is lowest
            answers = [_send(url, prompts[c]) for c in range(CONVERSATIONS)]
        for c, resp in enumerate(answers):
            route = route_of(resp)
            producers = route["producers"]
            assert producers, route  # every turn's suffix is past max_suffix_tokens
            answer = resp.json()
            turns.append(
                _Turn(
                    c, turn, str(producers[0]["name"]),  # type: ignore[index]
                    int(route["predicted_producer_cached_tokens"]),  # type: ignore[call-overload]
                    int(route["predicted_cached_tokens"]),  # type: ignore[call-overload]
                    answer["usage"]["prompt_tokens_details"]["cached_tokens"],
                )
            )  # fmt: skip
            tokens = answer["choices"][0]["token_ids"]
            prompts[c] = [*prompts[c], *tokens, *prompt_ids(2000 + 10 * c + turn, USER_TOKENS)]
    after = _checks(url)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    report = "\n".join(f"{t}" for t in turns)
    for leg in ("producer", "consumer"):
        total = sum(v for (lg, _), v in delta.items() if lg == leg)
        close = delta.get((leg, "exact"), 0.0) + delta.get((leg, "block"), 0.0)
        assert total >= len(turns) * 0.95, (leg, delta, report)  # every leg was checked
        assert close >= 0.95 * total, (leg, delta, report)
    # The consumer's own prefix, per request, from the client's side as well.
    near = [t for t in turns if abs(t.consumer_cached - t.predicted_consumer) < VLLM_BLOCK_SIZE]
    assert len(near) >= 0.95 * len(turns), report
    # Producer-side routing paid: both producers served, and every later turn went to the
    # producer that held its conversation (what it reported cached is checked above).
    assert {t.producer for t in turns} == {"p0", "p1"}, report
    for c in range(CONVERSATIONS):
        mine = [t for t in turns if t.conversation == c]
        assert len({t.producer for t in mine}) == 1, report
        assert all(t.predicted_producer > 0 for t in mine[1:]), report
    print(f"\nprediction checks: {delta}\n{report}")
