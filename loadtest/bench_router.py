"""Benchmark of the KV-aware router (prints; asserts nothing).

    python -m loadtest.bench_router [--decisions 500] [--nodes 1024 [--all-candidates]]
        [--rounds 2] [--baseline-tree DIR] [--workload] [--redis-url URL] [--redis-deadline-s 1]
        [--kv-option local_prefill.max_suffix_tokens=0 ...]

1. Decision time for an 8,192-token prompt over 8 candidates (4 producers + 4 consumers, each
   holding a random prefix of the prompt) among ``--nodes`` nodes in the index (one in eight of
   the others holds a prefix of it too, the rest other prompts); ``--all-candidates`` ranks all
   of them: the router's ``decide`` (hash + match + score) and its whole
   ``route`` (plus load charge and prediction writes), p50/p99, with the in-memory index and with
   Redis (:mod:`loadtest.router_decisions`, one child process per measurement). Floors measured
   in the same run: hashing alone, and one Redis PING round trip. ``--baseline-tree DIR`` (another
   checkout, e.g. ``git archive`` of the commit before a change) is measured in the same run, its
   rounds alternating with this tree's, and the table prints this tree's p50/p99 as ratios of
   the baseline's. Redis: ``--redis-url`` or a redis-server this benchmark starts and stops;
   ``--redis-deadline-s`` (1 s here, 20 ms in production) keeps slow calls measured rather than
   turned into load-only fallbacks (their count is printed).
2. ``--workload``: a shared-prefix workload (``--groups`` x ``--per-group`` prompts sharing a
   ``--system-tokens`` system prompt) on real ``sim`` workers (2 producers + 2 consumers, prefill
   time proportional to uncached tokens) behind the real proxy, started by ``pdproxy.stack`` once
   per router: mean/p99 TTFT and prefix hit rate (:mod:`loadtest.prefix_workload`) for
   KV-aware vs round-robin vs least-loaded. Each router's run is bounded by ``--time-limit-s``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from loadtest import prefix_workload
from loadtest.local_stack import local_stack
from loadtest.redis_server import own_redis_server

BACKENDS = ("memory", "redis")


def _pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _child(tree: str, backend: str, args: argparse.Namespace, url: str) -> dict[str, Any]:
    """One measurement of ``tree``'s router (:mod:`loadtest.router_decisions`, run by path
    from this tree with ``tree`` on ``PYTHONPATH``)."""
    cmd = [
        sys.executable, str(Path(__file__).with_name("router_decisions.py")),
        "--backend", backend, "--decisions", str(args.decisions), "--nodes", str(args.nodes),
    ]  # fmt: skip
    if args.all_candidates:
        cmd.append("--all-candidates")
    if backend == "redis":
        cmd += ["--redis-url", url, "--deadline-s", str(args.redis_deadline_s)]
    env = {**os.environ, "PYTHONPATH": tree}
    done = subprocess.run(
        cmd, env=env, cwd=tree, capture_output=True, text=True, timeout=600, check=False
    )
    if done.returncode != 0:
        raise SystemExit(f"measurement of {tree} ({backend}) failed:\n{done.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


Cells = dict[tuple[str, str], dict[str, list[float]]]


def _measure_trees(
    args: argparse.Namespace, trees: dict[str, str]
) -> tuple[Cells, dict[tuple[str, str], float]]:
    """Each round measures every (tree, backend) once, the trees' order alternating, so load
    drift on a shared machine hits both trees alike; samples of all rounds are pooled."""
    pooled: Cells = {}
    fallbacks: dict[tuple[str, str], float] = {}
    with contextlib.ExitStack() as stack:
        url = args.redis_url or stack.enter_context(own_redis_server())
        for r in range(args.rounds):
            order = list(trees.items())
            if r % 2:
                order.reverse()
            for backend in BACKENDS:
                for label, tree in order:
                    got = _child(tree, backend, args, url)
                    cell = pooled.setdefault((label, backend), {})
                    for what, values in got["samples"].items():
                        cell.setdefault(what, []).extend(values)
                    key = (label, backend)
                    fallbacks[key] = fallbacks.get(key, 0.0) + float(got["fallbacks"])
    return pooled, fallbacks


def _decision_time(args: argparse.Namespace) -> None:
    here = str(Path(__file__).resolve().parent.parent)
    trees = {"this": here}
    if args.baseline_tree:
        trees["base"] = str(Path(args.baseline_tree).resolve())
    pooled, fallbacks = _measure_trees(args, trees)
    nodes = max(args.nodes, 8)
    scored = f"all {nodes}" if args.all_candidates else "8 (4P+4C)"
    print(
        f"Decision time, 8,192-token prompt (512 blocks), {nodes} nodes in the index (the "
        f"first 8 and one in eight of the others hold random prefixes of it), candidates: "
        f"{scored}; {args.rounds} round(s) x {args.decisions} decisions per tree and backend"
    )
    print("  trees: " + ", ".join(f"{label} = {tree}" for label, tree in trees.items()))
    based = "base" in trees
    head = f"  {'tree':<6}{'backend':<8}{'what':<8}{'p50 µs':>9}{'p99 µs':>9}"
    if based:
        head += f"{'p50/base':>10}{'p99/base':>10}"
    print(head + f"{'p50/floor':>11}")
    floors = {}
    for label in trees:
        hash_p50 = _pct(pooled[label, "memory"]["hash"], 0.5)
        floors[label, "memory"] = hash_p50
        floors[label, "redis"] = hash_p50 + _pct(pooled[label, "redis"]["ping"], 0.5)
    for backend in BACKENDS:
        for what in ("decide", "route", "match", "cpu"):
            for label in trees:
                values = pooled[label, backend][what]
                p50, p99 = _pct(values, 0.5), _pct(values, 0.99)
                line = f"  {label:<6}{backend:<8}{what:<8}{p50 * 1000:9.0f}{p99 * 1000:9.0f}"
                if based and label == "this":
                    base = pooled["base", backend][what]
                    line += f"{p50 / _pct(base, 0.5):9.2f}x{p99 / _pct(base, 0.99):9.2f}x"
                elif based:
                    line += " " * 20
                print(line + f"{p50 / floors[label, backend]:10.1f}x")
    for label in trees:
        hashing = pooled[label, "memory"]["hash"]
        ping = pooled[label, "redis"]["ping"]
        print(
            f"  {label}: floors: hashing alone p50/p99 {_pct(hashing, 0.5) * 1000:.0f}/"
            f"{_pct(hashing, 0.99) * 1000:.0f} µs, redis PING {_pct(ping, 0.5) * 1000:.0f}/"
            f"{_pct(ping, 0.99) * 1000:.0f} µs; redis fallbacks {fallbacks[label, 'redis']:.0f}"
        )
    print(
        "  decide: hash+match+load+score (the router's clock); route: +charge, +predictions; "
        "match: the index alone (among the candidates where the tree supports it); cpu: "
        "process CPU per route; p50/floor: vs hashing alone (memory), hashing + one PING (redis)"
    )
    print("  targets: decide p99 <= 500 µs (memory), <= 2000 µs (redis)")


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the stack started inside (the proxy reads its router
    options from ``PDPROXY_ROUTER_OPTIONS__*`` on top of its config file)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _workload(args: argparse.Namespace) -> None:
    print(f"\nShared-prefix workload: {prefix_workload.describe(args)}, {args.num_pages} pages")
    rows: dict[str, prefix_workload.QualityRow] = {}
    variant_env = {
        "PDPROXY_ROUTER_OPTIONS__" + key.replace(".", "__").upper(): value
        for key, _, value in (opt.partition("=") for opt in args.kv_option)
    }
    runs: list[tuple[str, str, dict[str, str]]] = [("kv", "kv", {})]
    if variant_env:
        runs.append(("kv+options", "kv", variant_env))
    runs += [("round_robin", "round_robin", {}), ("least_loaded", "least_loaded", {})]
    for label, router, env in runs:
        stack_args = prefix_workload.stack_args(args, router)
        with _environment(env), local_stack(stack_args) as stack:
            rows[label] = prefix_workload.run(args, stack)
    rr_mean = rows["round_robin"].mean_ttft_ms or 1e-9
    print(f"  {'router':<14}{'mean TTFT':>12}{'p99 TTFT':>12}{'hit rate':>10}"
          f"{'ok':>6}{'failed':>8}{'mean vs RR':>12}")  # fmt: skip
    for router, r in rows.items():
        print(f"  {router:<14}{r.mean_ttft_ms:>10.1f}ms{r.p99_ttft_ms:>10.1f}ms{r.hit_rate:>10.1%}"
              f"{r.ok:>6}{r.failed:>8}{r.mean_ttft_ms / rr_mean:>11.2f}x")  # fmt: skip
    if variant_env:
        print(f"  kv+options: {' '.join(args.kv_option)}")
    print("  target: KV-aware mean TTFT <= 0.5x round-robin")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--decisions", type=int, default=500, help="per round, tree, backend")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--baseline-tree", metavar="DIR", help="another checkout measured in the same run"
    )
    parser.add_argument("--redis-url", default=None)
    parser.add_argument(
        "--redis-deadline-s",
        type=float,
        default=1.0,
        help="the routers' redis_deadline_s (production: 0.02). Raised so that a slow call on "
        "a busy machine is measured: at 20 ms it opens the breaker, and the fast load-only "
        "decisions that follow hide it",
    )
    parser.add_argument("--nodes", type=int, default=1024, help="nodes in the index (>= 8)")
    parser.add_argument(
        "--all-candidates", action="store_true", help="every node is a routing candidate"
    )
    parser.add_argument("--workload", action="store_true", help="also run the sim workload")
    prefix_workload.add_arguments(
        parser, groups=32, per_group=16, rate=6.0, time_limit_s=150, time_limit_help="per router"
    )
    parser.add_argument(
        "--kv-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="adds a KV-aware run with this router option changed, e.g. "
        "weights.in_flight_tokens=0 or local_prefill.max_suffix_tokens=0 (repeatable)",
    )
    args = parser.parse_args()
    _decision_time(args)
    if args.workload:
        _workload(args)


if __name__ == "__main__":
    main()
