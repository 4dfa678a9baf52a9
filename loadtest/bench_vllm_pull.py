"""A warm producer and a holder inside real vLLM (kvtier's connector): TTFT against the cold case.

One kvtier pair (``p1`` producer/holder, ``d1`` consumer/puller, both ``kv_both``). Every round
takes three fresh prompts, one per case, in rotating order so the shared machine's noise falls
on all of them (one token each, so a leg's latency is its TTFT):

- ``cold``: PD on a prompt neither instance has seen: producer leg on p1, consumer leg on d1;
- ``warm``: p1 first computes the prompt alone (a plain request, not timed), then the same PD
  legs: the producer's blocks are all prefix-cache hits, copied from vLLM's KV cache into host
  pages for the supply (the seed's "warm producer" scenario);
- ``pull``: p1 supplies the prompt once (a producer leg, not timed: its blocks land in p1's host
  pages), then d1 is sent the prompt with ``{"remote_kv_source": p1}`` (timed): an offer round
  trip, then the same fetch as a consumer leg.

Printed: p50/p90 of the producer leg, the consumer leg and their sum (the PD request's TTFT
without the proxy), per case; ratios warm/cold, and a pull against the consumer legs of both PD
cases (the same fetch without the offer), same run. Asserts nothing.

    python -m loadtest.bench_vllm_pull [--rounds 8] [--prompt-tokens 1920]

Needs ``scripts/dev vllm-setup`` (``PDPROXY_VLLM_VENV`` / ``PDPROXY_VLLM_MODEL_DIR`` as there).
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Sequence

import httpx

from loadtest import vllm_fleet
from loadtest.serving_metrics import nearest_rank
from pdproxy.stack.vllm_engine import VllmConnector, VllmInstance, VllmPaths, VllmRole

CASES = ("cold", "warm", "pull")
KVTIER = VllmConnector.KVTIER


def pd_round(
    client: httpx.Client, p1: VllmInstance, d1: VllmInstance, prompt: list[int]
) -> tuple[float, float]:
    """Producer leg then consumer leg; their latencies."""
    produce_s, produced = vllm_fleet.producer_leg(client, p1.url, KVTIER, prompt)
    leg = vllm_fleet.consumer_params(KVTIER, produced)
    consume_s, _ = vllm_fleet.timed_completion(client, d1.url, vllm_fleet.one_token(prompt, leg))
    return produce_s, consume_s


def pull_round(
    client: httpx.Client, p1: VllmInstance, d1: VllmInstance, prompt: list[int]
) -> float:
    """p1 supplies the prompt (untimed, its supply left to its lease); d1 pulls it (timed)."""
    _, produced = vllm_fleet.producer_leg(client, p1.url, KVTIER, prompt)
    source = {
        "remote_kv_source": {
            "remote_host": produced["remote_host"],
            "remote_port": produced["remote_port"],
            "remote_engine_id": produced["remote_engine_id"],
        }
    }
    seconds, _ = vllm_fleet.timed_completion(client, d1.url, vllm_fleet.one_token(prompt, source))
    return seconds


def report(legs: dict[str, dict[str, list[float]]]) -> str:
    rows = [f"{'case':<6} {'leg':<9} {'p50 ms':>8} {'p90 ms':>8}"]
    for case, by_leg in legs.items():
        for leg, values in by_leg.items():
            mid, high = nearest_rank(values, 0.5) * 1e3, nearest_rank(values, 0.9) * 1e3
            rows.append(f"{case:<6} {leg:<9} {mid:>8.0f} {high:>8.0f}")
    p50 = {(c, leg): nearest_rank(v, 0.5) for c, by in legs.items() for leg, v in by.items()}
    rows.append(
        f"warm/cold p50: producer leg {p50['warm', 'producer'] / p50['cold', 'producer']:.2f}, "
        f"PD total {p50['warm', 'total'] / p50['cold', 'total']:.2f}; "
        f"pull/consumer leg p50: cold {p50['pull', 'consumer'] / p50['cold', 'consumer']:.2f}, "
        f"warm {p50['pull', 'consumer'] / p50['warm', 'consumer']:.2f} "
        f"(rounds: {len(legs['cold']['total'])})"
    )
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench_vllm_pull", description=__doc__)
    parser.add_argument("--rounds", type=int, default=8, help="rounds of the three cases (8)")
    parser.add_argument("--prompt-tokens", type=int, default=1920, help="1920: 15 blocks")
    return vllm_fleet.run_with_vllm(parser, argv, _run)


def _run(args: argparse.Namespace, paths: VllmPaths) -> int:
    fleet = vllm_fleet.VllmFleet.create(paths, "bench-vllm-pull-")
    p1 = fleet.instance("p1", VllmRole.PRODUCER, KVTIER)
    d1 = fleet.instance("d1", VllmRole.CONSUMER, KVTIER)
    legs: dict[str, dict[str, list[float]]] = {
        "cold": {"producer": [], "consumer": [], "total": []},
        "warm": {"producer": [], "consumer": [], "total": []},
        "pull": {"consumer": []},
    }
    rng = random.Random(0)
    print(f"starting 2 vLLM instances (logs in {fleet.run_dir}/logs) ...", flush=True)
    started = time.monotonic()
    with fleet.running([p1, d1], args.startup_timeout) as client:
        print(f"up in {time.monotonic() - started:.0f} s", flush=True)
        for i in range(args.rounds):
            order = CASES[i % 3 :] + CASES[: i % 3]
            for case in order:
                prompt = [rng.randrange(3, 500) for _ in range(args.prompt_tokens)]
                if case == "pull":
                    legs["pull"]["consumer"].append(pull_round(client, p1, d1, prompt))
                    continue
                if case == "warm":  # p1 alone first: its prefix cache
                    vllm_fleet.post_completion(client, p1.url, vllm_fleet.one_token(prompt))
                produce_s, consume_s = pd_round(client, p1, d1, prompt)
                legs[case]["producer"].append(produce_s)
                legs[case]["consumer"].append(consume_s)
                legs[case]["total"].append(produce_s + consume_s)
        print(report(legs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
