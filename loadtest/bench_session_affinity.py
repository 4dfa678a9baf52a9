"""Session affinity on vs off, side by side in one run, on a multi-turn workload.

Four sim reference workers (aggregated: each prefills alone) behind two KV-router proxies that
differ only in ``router_options.affinity.enabled``. The routers get no KV events (the index is
empty: events disabled or lagging) and predictions last 50 ms (a user thinks for longer), so
between turns only affinity remembers where a conversation's KV is. Each conversation sends
``--turns`` turns, each prompt the whole history plus a new question, with ``x-session-id``;
``--concurrency`` conversations run at once. Both proxies get the same kind of workload with
different texts (the workers' caches are shared across the two runs), off first, then on.

Prints, per proxy, mean TTFT and prefix hit rate (``cached_tokens / prompt_tokens`` from the
usage chunk) over the turns after the first, and the ratios on/off::

    python -m loadtest.bench_session_affinity --conversations 16 --turns 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from loadtest.child import child_process
from pdproxy.stack.ports import free_port


def _process(argv: list[str], log: Path) -> AbstractContextManager[subprocess.Popen[bytes]]:
    """A child without the caller's KVTIER_/PDPROXY_ settings (each run sets its own)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVTIER_", "PDPROXY_"))}
    return child_process(argv, env=env, log=log)


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url}: not healthy within {timeout_s} s")


@dataclass
class Tally:
    ttft: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    errors: int = 0

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


async def _turn(
    client: httpx.AsyncClient, url: str, session: str, prompt: str, tokens: int
) -> tuple[float, str, dict[str, int]]:
    body = {
        "prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    t0 = time.perf_counter()
    ttft = 0.0
    text = ""
    usage: dict[str, int] = {}
    async with client.stream(
        "POST", f"{url}/v1/completions", json=body, headers={"x-session-id": session}
    ) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if not ttft:
                ttft = time.perf_counter() - t0
            for choice in chunk.get("choices") or []:
                text += choice.get("text", "")
            if chunk.get("usage"):
                usage = {
                    "prompt": chunk["usage"]["prompt_tokens"],
                    "cached": (chunk["usage"].get("prompt_tokens_details") or {}).get(
                        "cached_tokens", 0
                    ),
                }
    return ttft, text, usage


async def _conversation(
    client: httpx.AsyncClient, url: str, name: str, args: argparse.Namespace, tally: Tally
) -> None:
    rng = random.Random(name)
    words = ["fox", "block", "cache", "token", "river", "engine", "prefix", "turn", "node"]
    history = f"[{name}] " + " ".join(rng.choice(words) for _ in range(args.system_words))
    for turn in range(args.turns):
        history += "\nQ: " + " ".join(rng.choice(words) for _ in range(args.question_words))
        try:
            ttft, text, usage = await _turn(client, url, name, history + "\nA:", args.tokens)
        except httpx.HTTPError:
            tally.errors += 1
            return
        history += "\nA:" + text
        if turn == 0:
            continue  # a first turn has nothing to stick to
        tally.ttft.append(ttft)
        tally.prompt_tokens += usage.get("prompt", 0)
        tally.cached_tokens += usage.get("cached", 0)
        await asyncio.sleep(args.think_s)


async def _load(url: str, tag: str, args: argparse.Namespace) -> Tally:
    tally = Tally()
    gate = asyncio.Semaphore(args.concurrency)

    async def one(i: int) -> None:
        async with gate:
            await _conversation(client, url, f"{tag}-{i}", args, tally)

    async with httpx.AsyncClient(timeout=120) as client:
        await asyncio.gather(*(one(i) for i in range(args.conversations)))
    return tally


def _proxy_config(port: int, workers: list[str], affinity: bool) -> dict[str, object]:
    return {
        "host": "127.0.0.1",
        "port": port,
        "log_level": "warning",
        "backends": [
            {"name": f"w{i}", "url": url, "role": "consumer", "dialect": "p2p"}
            for i, url in enumerate(workers)
        ],
        "router": "kv",
        "router_options": {"prediction_ttl_s": 0.05, "affinity": {"enabled": affinity}},
        "health": {"enabled": False},
        "workers": 1,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--system-words", type=int, default=300)
    parser.add_argument("--question-words", type=int, default=30)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--think-s", type=float, default=0.1)
    parser.add_argument("--prefill-ms-per-token", type=float, default=0.05)
    parser.add_argument("--decode-ms-per-step", type=float, default=2.0)
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="bench-affinity-") as tmp, ExitStack() as stack:
        run = Path(tmp)
        workers: list[str] = []
        procs = []
        for i in range(args.workers):
            port = free_port()
            argv_w = [
                sys.executable, "-m", "kvtier.worker", "--role", "consumer", "--model", "sim",
                "--port", str(port), "--log-level", "warning", "--engine-id", f"w{i}",
                "--num-pages", "4096", "--host-pages", "64", "--max-model-len", "16384",
                "--torch-threads", "1",
                "--sim-prefill-ms-per-token", str(args.prefill_ms_per_token),
                "--sim-decode-ms-per-step", str(args.decode_ms_per_step),
            ]  # fmt: skip
            procs.append(stack.enter_context(_process(argv_w, run / f"w{i}.log")))
            workers.append(f"http://127.0.0.1:{port}")
        for url, proc in zip(workers, procs, strict=True):
            _wait_healthy(url, proc)
        proxies: dict[str, str] = {}
        for name, enabled in (("off", False), ("on", True)):
            port = free_port()
            config = run / f"proxy-{name}.yaml"
            config.write_text(yaml.safe_dump(_proxy_config(port, workers, enabled)))
            argv_p = [sys.executable, "-m", "pdproxy.cli", "serve", "--config", str(config)]
            proc = stack.enter_context(_process(argv_p, run / f"proxy-{name}.log"))
            proxies[name] = f"http://127.0.0.1:{port}"
            _wait_healthy(proxies[name], proc)
        results = {name: asyncio.run(_load(url, name, args)) for name, url in proxies.items()}

    print(
        f"workload: {args.conversations} conversations x {args.turns} turns, "
        f"{args.concurrency} at once, {args.workers} sim workers, no KV events"
    )
    for name, t in results.items():
        print(
            f"affinity {name:>3}: turns>1 {len(t.ttft):4d}  "
            f"mean TTFT {statistics.mean(t.ttft) * 1e3:7.1f} ms  "
            f"prefix hit rate {t.hit_rate:6.1%}  errors {t.errors}"
        )
    on, off = results["on"], results["off"]
    print(
        f"ratio on/off: mean TTFT {statistics.mean(on.ttft) / statistics.mean(off.ttft):.2f}x  "
        f"prefix hit rate {on.hit_rate:.1%} vs {off.hit_rate:.1%}"
    )


if __name__ == "__main__":
    main()
