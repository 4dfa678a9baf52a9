"""Real vLLM (CPU build) behind pdproxy: the instances are started once for this package.

Three vLLM instances, each ~46 s to start and ~3 GiB: ``p0`` (NIXL producer), ``d0`` (NIXL
consumer) and ``r0`` (a plain single node: the reference output, and the second node of the
routing test). Two proxies in front: ``pd`` (p0 → d0, always disaggregated) and ``agg`` (d0 and
r0 as one aggregated pool, KV-aware). All are stopped by PID when the package's tests end.

The vLLM venv and model come from ``scripts/dev vllm-setup`` (``scripts/dev test`` runs it).
Where vLLM cannot run on the machine, the setup says why and these tests skip with that reason;
where it merely was not set up, they skip locally but fail under ``scripts/dev test`` / CI.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from pdproxy.stack.process import ChildProcess
from pdproxy.stack.supervisor import Supervisor
from pdproxy.stack.vllm_engine import (
    SERVED_NAME,
    VllmInstance,
    VllmPaths,
    VllmRole,
    proxy_backend,
    vllm_instance,
)
from pdproxy.stack.vllm_plan import proxy_config
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 600.0
"""Three instances starting together on two shared cores: generous on purpose."""


def vllm_paths() -> VllmPaths:
    env = os.environ
    venv = Path(env.get("PDPROXY_VLLM_VENV") or ROOT / ".venv-vllm")
    return VllmPaths.resolve(venv, None)


def _need_vllm() -> VllmPaths:
    paths = vllm_paths()
    problem = paths.problem()
    if problem is None:
        return paths
    if (paths.venv / ".unsupported").is_file():
        pytest.skip(problem)
    if os.environ.get("CI") or os.environ.get("PDPROXY_VLLM_VENV"):
        pytest.fail(f"{problem} (scripts/dev test runs the setup; it must have worked)")
    pytest.skip(problem)


@dataclass(frozen=True, slots=True)
class VllmStack:
    paths: VllmPaths
    instances: dict[str, VllmInstance]
    pd_url: str
    """Proxy: producer p0, consumer d0, always disaggregated."""
    agg_url: str
    """Proxy: d0 and r0 as one aggregated pool, KV-aware routing."""
    supervisor: Supervisor
    log_dir: Path

    def url(self, name: str) -> str:
        return self.instances[name].url

    def child(self, name: str) -> ChildProcess:
        return next(c for c in self.supervisor.children if c.spec.name == name)


def _write_proxy(run_dir: Path, name: str, config: dict[str, object]) -> tuple[str, list[str]]:
    port = free_port()
    # The tests read /metrics right after what they count: no answer from the merge cache of a
    # --workers group (metrics_cache_s, up to a second old by default).
    config = {**config, "port": port, "debug_headers": True, "metrics_cache_s": 0}
    path = run_dir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    argv = [
        sys.executable, "-m", "pdproxy.cli", "serve", "--config", str(path), "--log-level", "info",
    ]  # fmt: skip
    return f"http://127.0.0.1:{port}", argv


@pytest.fixture(scope="package")
def vllm_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmStack]:
    from pdproxy.stack.process import ProcessSpec

    paths = _need_vllm()
    run_dir = tmp_path_factory.mktemp("vllm")
    sockets = run_dir / "sockets"
    sockets.mkdir(mode=0o700)
    log_dir = run_dir / "logs"
    # NIXL side channels bind only once their engine has started, a minute later: a port from
    # bind(0) lies in the ephemeral range, where the other instances' ZMQ/UCX sockets land
    # meanwhile (a CI run lost d0 to "address already in use" on its side channel).
    side_channels: list[int] = []

    def side_channel_port() -> int:
        side_channels.append(free_port())
        return side_channels[-1]

    instances = {
        name: vllm_instance(
            name,
            role,
            paths,
            http_port=free_port(),
            side_channel_port=side_channel_port(),
            socket_dir=sockets,
        )
        for name, role in (
            ("p0", VllmRole.PRODUCER),
            ("d0", VllmRole.CONSUMER),
            ("r0", VllmRole.SINGLE),
        )
    }
    pd_backends = [proxy_backend(instances["p0"]), proxy_backend(instances["d0"])]
    pd = proxy_config(pd_backends, paths, host="127.0.0.1", port=0)
    # Always disaggregate, so every PD test really moves KV over NIXL (a warm TTFT model keeps
    # to it: `ttft.bypass` unset follows these thresholds).
    pd["router_options"]["local_prefill"] = {"max_suffix_tokens": 0, "min_hit_ratio": 1.0}
    agg_backends = [
        {**proxy_backend(instances["d0"]), "dialect": "none", "role": "consumer"},
        proxy_backend(instances["r0"]),
    ]
    agg = proxy_config(agg_backends, paths, host="127.0.0.1", port=0)
    # Predictions written at routing time expire fast, so the routing test sees events only.
    agg["router_options"]["prediction_ttl_s"] = 0.05
    # A stream whose consumer dies moves to the other one (test_failover).
    agg["failover"] = {"max_migrations": 1}
    env = {"PYTHONPATH": str(ROOT)}
    started = time.monotonic()
    with Supervisor(log_dir, stop_grace_s=15.0) as supervisor:
        supervisor.start([i.spec for i in instances.values()])
        supervisor.wait_healthy(STARTUP_TIMEOUT_S)
        # The proxies' ports are picked only now: while vLLM starts, NIXL/UCX and ZMQ bind
        # ephemeral ports of their own, and one of them took a port picked earlier (a CI run
        # failed with "address already in use").
        pd_url, pd_argv = _write_proxy(run_dir, "pd", pd)
        agg_url, agg_argv = _write_proxy(run_dir, "agg", agg)
        proxies = [
            ProcessSpec("pd-proxy", tuple(pd_argv), pd_url + "/ready", env, "proxy"),
            ProcessSpec("agg-proxy", tuple(agg_argv), agg_url + "/ready", env, "proxy"),
        ]
        supervisor.start(proxies)
        supervisor.wait_healthy(60.0)
        _first_pd_request(pd_url, supervisor)
        print(f"\nvLLM stack up in {time.monotonic() - started:.0f} s (logs in {log_dir})")
        yield VllmStack(paths, instances, pd_url, agg_url, supervisor, log_dir)
    expired = _expired_reads(log_dir / "p0.log")
    if expired:
        pytest.fail(
            f"d0 read KV blocks p0 had already released: {expired}\n"
            + stack_log_tails(log_dir, ("pd-proxy", "d0", "p0"))
        )


def _first_pd_request(pd_url: str, supervisor: Supervisor) -> None:
    """PD requests before any test until one is served over NIXL: d0's first NIXL handshake with
    p0 (20-30 s on two shared cores, d0's engine unresponsive meanwhile) is not charged to
    whichever test comes first.

    Repeated because on two shared cores that handshake can fail outright: vLLM 0.32 waits 5 s
    (hard-coded ``RCVTIMEO``) for p0's metadata reply and, under its default
    ``kv_load_failure_policy=fail``, fails the request ("handshake_failed", then a 500); the
    proxy has d0 prefill it alone (``x-pdproxy-fallback``), so that answer proves nothing about
    NIXL. The next request starts a new handshake. The stack keeps vLLM's policy so that every
    answer without the fallback header proves the KV came over NIXL.
    """
    body = {"model": MODEL, "prompt": prompt_ids(0, 300), "max_tokens": 2, "temperature": 0}
    failures: list[str] = []
    for _ in range(_FIRST_REQUEST_ATTEMPTS):
        resp = httpx.post(pd_url + "/v1/completions", json=body, timeout=STARTUP_TIMEOUT_S)
        fallback = resp.headers.get("x-pdproxy-fallback")
        if resp.status_code == 200 and fallback is None:
            if failures:
                print(f"\nfirst PD request over NIXL after {len(failures)} tries: {failures}")
            return
        failures.append(f"{resp.status_code} (fallback: {fallback}) {resp.text[:200]}")
    logs = "\n".join(
        f"--- {c.log_path}:\n{c.log_tail(40)}"
        for c in supervisor.children
        if c.spec.name in ("pd-proxy", "p0", "d0")
    )
    pytest.fail(f"no PD request served over NIXL in {len(failures)} tries: {failures}\n{logs}")


_FIRST_REQUEST_ATTEMPTS = 3


def _expired_reads(producer_log: Path) -> list[str]:
    """vLLM's own report that a consumer read blocks whose lease had expired (their content
    may belong to another request by then)."""
    if not producer_log.is_file():
        return []
    lines = producer_log.read_text(errors="replace").splitlines()
    return [line[-200:] for line in lines if "Potentially invalid KV blocks" in line]


LOG_TAIL_LINES = 60


def stack_log_tails(log_dir: Path, names: tuple[str, ...], lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of each named process's log: a CI failure of this package
    must carry what the engines and proxies were doing (a run on a fresh machine leaves no
    files behind to read afterwards)."""
    parts = []
    for name in names:
        path = log_dir / f"{name}.log"
        if path.is_file():
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {name}.log (last {len(tail)} lines)\n" + "\n".join(tail))
    return "\n".join(parts)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failed test of the shared stack reports the stack's log tails beside its traceback."""
    report = yield
    stack = getattr(item, "funcargs", {}).get("vllm_stack")
    if report.failed and isinstance(stack, VllmStack):
        names = ("pd-proxy", "agg-proxy", "p0", "d0", "r0")
        report.sections.append(("vLLM stack logs", stack_log_tails(stack.log_dir, names)))
    return report


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that kill an instance run after every other test of the shared stack (the one
    killing a consumer last: the producer's test needs both consumers); the package's tests
    keep their place in the session (the stack starts once)."""
    here = Path(__file__).parent
    slots = [i for i, item in enumerate(items) if here in item.path.parents]

    def kills(item: pytest.Item) -> tuple[bool, bool]:
        names = getattr(item, "fixturenames", ())
        return "kills_consumer" in names, "kills_producer" in names

    ours = sorted((items[i] for i in slots), key=kills)
    for i, item in zip(slots, ours, strict=True):
        items[i] = item


@pytest.fixture
def kills_producer(vllm_stack: VllmStack) -> VllmStack:
    """Marks a test that kills p0: it runs last (see ``pytest_collection_modifyitems``)."""
    return vllm_stack


@pytest.fixture
def kills_consumer(vllm_stack: VllmStack) -> VllmStack:
    """Marks a test that kills d0 or r0: it runs after every other (see
    ``pytest_collection_modifyitems``)."""
    return vllm_stack


_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][\w:]*)(?P<labels>\{[^}]*\})?\s+(?P<value>\S+)$")


def vllm_metric(url: str, name: str) -> float:
    """Sum of a vLLM Prometheus metric's samples (all label sets)."""
    text = httpx.get(url + "/metrics", timeout=10.0).text
    total = 0.0
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and m["name"] == name:
            total += float(m["value"])
    return total


def prompt_ids(seed: int, n: int, vocab: int = 500) -> list[int]:
    """``n`` token ids, distinct per seed, that never hit another test's prefix cache entries.
    Ids stay clear of the special tokens (0..2) so vLLM counts exactly ``n`` prompt tokens."""
    import random

    rng = random.Random(f"prompt/{seed}")
    return [rng.randrange(3, vocab) for _ in range(n)]


def drift_buckets(url: str, mode: str) -> dict[str, float]:
    """The proxy's ``_cached_tokens_drift`` histogram for ``mode``: upper bound → count."""
    text = httpx.get(url + "/metrics", timeout=10.0).text
    out = {}
    for m in re.finditer(
        r'^pdproxy_kv_router_cached_tokens_drift_bucket\{le="([^"]+)",mode="(\w+)"\} (\S+)$',
        text,
        re.M,
    ):
        if m[2] == mode:
            out[m[1]] = float(m[3])
    return out


def route_of(resp: httpx.Response) -> dict[str, object]:
    raw = resp.headers.get("x-pdproxy-route")
    assert raw is not None, f"no x-pdproxy-route header: {dict(resp.headers)}"
    doc: dict[str, object] = json.loads(raw)
    return doc


MODEL = SERVED_NAME
