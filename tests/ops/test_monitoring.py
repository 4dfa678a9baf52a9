"""Prometheus config, rules and the Grafana dashboard against a real Prometheus and a live stack.

The stack is real processes on loopback (two sim workers with KV events and P2P, the proxy with
the KV router); Debian's ``prometheus`` scrapes them every second with the repository's rule
files, and every dashboard and rule expression is evaluated through its HTTP API.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import time
from collections.abc import Iterator

import httpx
import pytest
import yaml

from tests.conftest import free_port
from tests.ops.conftest import need_tool
from tests.ops.promql import (
    DASHBOARD,
    MONITORING,
    RULES_DIR,
    Expression,
    Prometheus,
    check,
    dashboard_expressions,
    metric_names,
    recorded_names,
    rule_expressions,
)
from tests.reliability.procs import ManagedProcess, ProcessGroup

pytestmark = [pytest.mark.slow]

CORE_PANELS = {
    "Requests by route and status",
    "TTFT at the proxy (p50, p90, p99)",
    "Engine TTFT (p50, p99)",
    "ITL and TPOT (p50, p99)",
    "Queue depth",
    "In flight by backend",
    "Breaker state by backend",
    "KV routing hit ratio",
    "Routing decisions by reason",
    "P2P bytes fetched",
    "Pinned host pool",
    "Device KV usage",
}
"""Panels that must show data once the stack has served traffic (others may be empty: no
errors, no 429s, no drift samples on a healthy run)."""


def test_promtool_accepts_the_config_and_rules() -> None:
    promtool = need_tool("promtool")
    config = MONITORING / "prometheus" / "prometheus.yml"
    out = subprocess.run(
        [promtool, "check", "config", str(config)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    rules = sorted(str(p) for p in RULES_DIR.glob("*.yml"))
    out = subprocess.run(
        [promtool, "check", "rules", *rules],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_dashboard_is_provisioned_with_the_datasource_it_names() -> None:
    grafana = MONITORING / "grafana"
    sources = yaml.safe_load((grafana / "provisioning/datasources/prometheus.yml").read_text())
    uids = {s["uid"] for s in sources["datasources"]}
    providers = yaml.safe_load((grafana / "provisioning/dashboards/pdproxy.yml").read_text())
    assert [p["options"]["path"] for p in providers["providers"]] == ["/var/lib/grafana/dashboards"]
    doc = json.loads(DASHBOARD.read_text())
    panels = [p for p in doc["panels"] if p["type"] != "row"]
    assert {p["datasource"]["uid"] for p in panels} <= uids
    assert {p["title"] for p in panels} >= CORE_PANELS
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))


def test_metric_names_are_read_from_expressions() -> None:
    expr = (
        'sum by (le, route) (rate(a_seconds_bucket{route=~"x.+", le!="1"}[5m])) '
        "/ on (route) group_left(backend) clamp_min(b_total offset 5m, 1e-9) > bool 2"
    )
    assert metric_names(expr) == {"a_seconds_bucket", "b_total"}


def _stack(procs: ProcessGroup) -> tuple[ManagedProcess, list[ManagedProcess]]:
    secret, key = secrets.token_hex(16), secrets.token_hex(16)
    workers = [
        procs.worker(name, role=role, events=True, secret=secret, api_key=key)
        for name, role in (("producer-0", "producer"), ("consumer-0", "consumer"))
    ]
    backends = [
        {
            "name": w.name, "url": w.url, "role": w.role, "dialect": "p2p", "api_key": key,
            "events_endpoint": w.events_endpoint,
        }
        for w in workers
    ]  # fmt: skip
    proxy = procs.proxy(
        "proxy",
        {
            "router": "kv",
            "router_options": {
                "model_seed": "kvtier-sim/seed=0",
                "block_size": 16,
                "local_prefill": {"max_suffix_tokens": 0, "min_hit_ratio": 1.0},
            },
            "backends": backends,
        },
    )
    return proxy, workers


def _traffic(proxy_url: str) -> None:
    system = "You answer questions about the shared context. " * 40
    with httpx.Client(base_url=proxy_url, timeout=60) as client:
        for i in range(6):
            body = {
                "model": "kvtier-sim",
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": f"question {i % 2}"},
                ],
                "max_tokens": 8,
                "stream": i % 2 == 0,
            }
            r = client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    exe = need_tool("prometheus")
    workdir = tmp_path_factory.mktemp("monitoring")
    procs = ProcessGroup(workdir)
    try:
        proxy, workers = _stack(procs)
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES_DIR / "*.yml")],
            "scrape_configs": [
                {"job_name": "pdproxy", "static_configs": [{"targets": [_hostport(proxy)]}]},
                {
                    "job_name": "kvtier-workers",
                    "static_configs": [{"targets": [_hostport(w) for w in workers]}],
                },
            ],
        }
        path = workdir / "prometheus.yml"
        path.write_text(yaml.safe_dump(config))
        port = free_port()
        prom = procs.command(
            "prometheus",
            [
                exe, f"--config.file={path}", f"--storage.tsdb.path={workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn",
            ],
            url=f"http://127.0.0.1:{port}",
        )  # fmt: skip
        prom.wait_healthy("/-/ready", timeout_s=60)
        api = Prometheus(prom.url)
        _wait(
            lambda: all(t["health"] == "up" for t in api.targets()) and len(api.targets()) == 3,
            "targets up",
        )
        # rate() needs a series to exist before the traffic it measures.
        _traffic(proxy.url)
        _wait(lambda: bool(api.query("sum(pdproxy_requests_total) > 0")), "first requests")
        time.sleep(2)
        _traffic(proxy.url)
        _wait(lambda: bool(api.query("sum(rate(pdproxy_requests_total[1m])) > 0")), "a rate")
        time.sleep(3)  # one more rule evaluation
        yield api
    finally:
        procs.close()


def _hostport(proc: ManagedProcess) -> str:
    return proc.url.removeprefix("http://")


def _wait(ready: object, what: str, timeout_s: float = 60.0) -> None:
    assert callable(ready)
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert time.monotonic() < deadline, f"Prometheus did not see {what} in time"
        time.sleep(0.5)


def test_every_dashboard_and_rule_expression_evaluates(prometheus: Prometheus) -> None:
    expressions = dashboard_expressions() + rule_expressions()
    verdicts = check(prometheus, expressions, recorded_names())
    problems = [f"{v.expression.where}: {v.problem}" for v in verdicts if v.problem]
    assert not problems, "\n".join(problems)
    health = prometheus.rule_health()
    assert set(health.values()) == {"ok"}, health
    empty = sorted(
        {v.expression.where for v in verdicts if v.series == 0}
        & {f"panel {t!r}" for t in CORE_PANELS}
    )
    assert not empty, f"core panels without data: {empty}"


def test_a_query_naming_a_missing_metric_is_caught(prometheus: Prometheus) -> None:
    typo = Expression("panel 'typo'", "sum(rate(pdproxy_request_total[$__rate_interval]))")
    undefined = Expression("panel 'variable'", "sum(pdproxy_queue_depth{instance=~'$host'})")
    bad = Expression("panel 'syntax'", "sum(rate(pdproxy_requests_total[1m])")
    verdicts = check(prometheus, [typo, undefined, bad], recorded_names())
    assert "pdproxy_request_total" in (verdicts[0].problem or "")
    assert "$host" in (verdicts[1].problem or "")
    assert verdicts[2].problem is not None
