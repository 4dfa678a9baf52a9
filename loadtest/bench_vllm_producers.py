"""Producer-side routing on real vLLM: prompt tokens the engines compute with pdproxy's KV router
vs round robin, both always disaggregated, on a multi-turn workload over two NIXL producers and
one consumer, counted by vLLM itself (``vllm:prompt_tokens_by_source_total``).

Turns are interleaved (turn t of every conversation, then turn t+1); each turn is the whole
conversation so far (prompt, the answer's token ids, a new user message). Each router gets
conversations of its own (other seeds), so neither finds the other's prefixes. Run with an even
and an odd number of conversations: with two producers and an even number, round robin sends a
conversation to the same producer every turn by accident (request i goes to producer i mod 2),
which is the KV router's choice too; with an odd number it alternates.

    python -m loadtest.bench_vllm_producers [--conversations 3 4] [--turns 4]
        [--user-tokens 300] [--answer-tokens 8]

Prints, per router and conversation count, tokens computed / found cached by the producers and
by the consumer, and the producers' computed tokens KV / round robin of the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import yaml

from kvtier.events import BlockRemoved, BlockStored, EventBatch, EventSubscriber
from loadtest.vllm_fleet import VllmFleet, run_with_vllm
from pdproxy.stack.ports import free_port
from pdproxy.stack.process import ProcessSpec
from pdproxy.stack.supervisor import Supervisor
from pdproxy.stack.vllm_engine import (
    SERVED_NAME,
    VllmConnector,
    VllmInstance,
    VllmPaths,
    VllmRole,
    proxy_backend,
)
from pdproxy.stack.vllm_plan import proxy_config

ROOT = Path(__file__).resolve().parents[1]
_SOURCE = re.compile(
    r'^vllm:prompt_tokens_by_source_total\{[^}]*source="(\w+)"[^}]*\} (\S+)$', re.M
)
_NIXL_LEG = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
             "remote_block_ids": None, "remote_host": None, "remote_port": None}  # fmt: skip


def ids(seed: str, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def by_source(client: httpx.Client, url: str) -> dict[str, float]:
    text = client.get(url + "/metrics").text
    return {m[1]: float(m[2]) for m in _SOURCE.finditer(text)}


@contextmanager
def event_counts(instances: dict[str, VllmInstance]) -> Iterator[Counter[tuple[str, str]]]:
    """Blocks each instance announced stored / removed (its KV events), while the block runs."""
    counts: Counter[tuple[str, str]] = Counter()
    stop = threading.Event()
    ready = threading.Event()

    async def follow() -> None:
        subs = []
        for name, inst in instances.items():

            async def on_batch(batch: EventBatch, name: str = name) -> None:
                for e in batch.events:
                    if isinstance(e, BlockStored):
                        counts[name, "stored"] += len(e.block_hashes)
                    elif isinstance(e, BlockRemoved):
                        counts[name, "removed"] += len(e.block_hashes)

            # Live only (no replay socket): the run's own events, not the engine's history.
            sub = EventSubscriber(inst.events_endpoint, None, on_batch=on_batch)
            await sub.__aenter__()
            subs.append(sub)
        ready.set()
        await asyncio.to_thread(stop.wait)
        await asyncio.sleep(2.0)  # the last batches of the run
        for sub in subs:
            await sub.__aexit__(None, None, None)

    thread = threading.Thread(target=asyncio.run, args=(follow(),), daemon=True)
    thread.start()
    ready.wait(30)
    try:
        yield counts
    finally:
        stop.set()
        thread.join(30)


def handshake(client: httpx.Client, producer: str, consumer: str, tries: int = 3) -> None:
    """The consumer's first NIXL handshake with ``producer``, outside the measurement."""
    prompt = ids(f"handshake/{producer}", 200)
    for _ in range(tries):
        leg = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": 1,
               "kv_transfer_params": _NIXL_LEG}  # fmt: skip
        answer = client.post(producer + "/v1/completions", json=leg).json()
        body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": 1,
                "kv_transfer_params": answer["kv_transfer_params"]}  # fmt: skip
        if client.post(consumer + "/v1/completions", json=body).status_code == 200:
            return
    raise SystemExit(f"no NIXL transfer {producer} -> {consumer} in {tries} tries")


def proxy_spec(
    run_dir: Path, name: str, backends: list[dict[str, Any]], paths: VllmPaths, router: str
) -> tuple[str, ProcessSpec]:
    port = free_port()
    config = proxy_config(backends, paths, host="127.0.0.1", port=port, router=router)
    config |= {"debug_headers": True, "metrics_cache_s": 0}
    if router == "kv":  # always disaggregate, like round robin
        config["router_options"]["local_prefill"] = {"max_suffix_tokens": 0, "min_hit_ratio": 1.0}
    path = run_dir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    argv = (sys.executable, "-m", "pdproxy.cli", "serve", "--config", str(path))
    url = f"http://127.0.0.1:{port}"
    return url, ProcessSpec(name, argv, url + "/ready", {"PYTHONPATH": str(ROOT)}, "proxy")


def workload(
    client: httpx.Client, url: str, tag: str, conversations: int, args: argparse.Namespace
) -> float | None:
    """Send the conversations' turns; the share of later turns whose producer served the
    conversation's previous turn (None: the router does not say which producer it chose)."""
    prompts = {c: ids(f"{tag}/{c}", args.user_tokens) for c in range(conversations)}
    last: dict[int, str] = {}
    same = 0.0
    named = False
    for turn in range(args.turns):
        for c in range(conversations):
            body = {"model": SERVED_NAME, "prompt": prompts[c], "max_tokens": args.answer_tokens,
                    "temperature": 0, "ignore_eos": True, "return_token_ids": True}  # fmt: skip
            resp = client.post(url + "/v1/completions", json=body, headers={"x-pdproxy-debug": "1"})
            resp.raise_for_status()
            if resp.headers.get("x-pdproxy-fallback"):
                raise SystemExit(f"{tag}: a request fell back to the consumer alone")
            # Round robin explains only its reason: its stickiness shows in the cache hits.
            rows = json.loads(resp.headers["x-pdproxy-route"]).get("producers") or [{}]
            producer = str(rows[0].get("name", "?"))
            named = named or producer != "?"
            same += 1.0 if last.get(c) == producer != "?" else 0.0
            last[c] = producer
            answer = resp.json()["choices"][0]["token_ids"]
            prompts[c] = [*prompts[c], *answer, *ids(f"{tag}/{c}/{turn}", args.user_tokens)]
    later: int = conversations * (args.turns - 1)
    return same / max(later, 1) if named else None


def bench(args: argparse.Namespace, paths: VllmPaths) -> int:
    fleet = VllmFleet.create(paths, "bench-vllm-producers-")
    nixl = VllmConnector.NIXL
    instances: dict[str, VllmInstance] = {
        "p0": fleet.instance("p0", VllmRole.PRODUCER, nixl),
        "p1": fleet.instance("p1", VllmRole.PRODUCER, nixl),
        "c0": fleet.instance("c0", VllmRole.CONSUMER, nixl),
    }
    print(f"run dir {fleet.run_dir}", file=sys.stderr)
    backends = [proxy_backend(i) for i in instances.values()]
    with fleet.running(list(instances.values()), args.startup_timeout) as client:
        for p in ("p0", "p1"):
            handshake(client, instances[p].url, instances["c0"].url)
        proxies = {
            r: proxy_spec(fleet.run_dir, r, backends, paths, r) for r in ("round_robin", "kv")
        }
        with Supervisor(fleet.run_dir / "proxy-logs", stop_grace_s=10.0) as supervisor:
            supervisor.start([spec for _, spec in proxies.values()])
            supervisor.wait_healthy(60.0)
            rows = []
            for conversations in args.conversations:
                for router, (url, _) in proxies.items():
                    before = {n: by_source(client, i.url) for n, i in instances.items()}
                    with event_counts(instances) as events:
                        tag = f"{router}/{conversations}"
                        sticky = workload(client, url, tag, conversations, args)
                    after = {n: by_source(client, i.url) for n, i in instances.items()}
                    d = {n: {s: after[n][s] - before[n].get(s, 0.0) for s in after[n]}
                         for n in instances}  # fmt: skip
                    rows.append((conversations, router, d, sticky, events))
    print(f"{args.turns} turns, {args.user_tokens}-token user messages, "
          f"{args.answer_tokens}-token answers, always disaggregated")  # fmt: skip
    print(f"{'conv':>4} {'router':<12} {'same producer':>13} {'prod computed':>13} "
          f"{'prod cached':>11} {'cons computed':>13} {'cons cached':>11} "
          f"{'cons transferred':>16}  KV events (blocks stored/removed)")  # fmt: skip
    computed: dict[tuple[int, str], float] = {}
    for conversations, router, d, sticky, events in rows:
        pc = d["p0"]["local_compute"] + d["p1"]["local_compute"]
        ph = d["p0"]["local_cache_hit"] + d["p1"]["local_cache_hit"]
        computed[conversations, router] = pc
        same = "n/a" if sticky is None else f"{sticky:.0%}"
        print(f"{conversations:>4} {router:<12} {same:>13} {pc:>13.0f} {ph:>11.0f} "
              f"{d['c0']['local_compute']:>13.0f} {d['c0']['local_cache_hit']:>11.0f} "
              f"{d['c0']['external_kv_transfer']:>16.0f}  "
              + " ".join(f"{n} {events[n, 'stored']}/{events[n, 'removed']}"
                         for n in instances))  # fmt: skip
    for conversations in args.conversations:
        ratio = computed[conversations, "kv"] / max(computed[conversations, "round_robin"], 1.0)
        print(f"{conversations} conversations: producers' computed tokens, kv / round robin = "
              f"{ratio:.2f}")  # fmt: skip
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, nargs="+", default=[3, 4])
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--user-tokens", type=int, default=300)
    parser.add_argument("--answer-tokens", type=int, default=8)
    return run_with_vllm(parser, argv, bench)


if __name__ == "__main__":
    sys.exit(main())
