"""Tracing configured by ``OTEL_*`` settings: spans reach a real OTLP/HTTP collector (a small
HTTP server in the test that decodes the protobuf export requests), and with tracing off no
OpenTelemetry SDK module is even imported."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from pdproxy.observe.trace_context import TraceParent
from pdproxy.settings import ProxySettings
from tests.pdproxy.conftest import FakeFactory, ProxyFactory, backend_entry, quick_settings

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE}-00f067aa0ba902b7-01"


@dataclass
class FakeCollector:
    """Received export requests: (path, headers, decoded body)."""

    url: str
    received: list[tuple[str, dict[str, str], ExportTraceServiceRequest]] = field(
        default_factory=list
    )

    def spans(self) -> dict[str, tuple[str, dict[str, object]]]:
        """name → (trace id, attributes) of every span received."""
        out: dict[str, tuple[str, dict[str, object]]] = {}
        for _, _, request in self.received:
            for resource_spans in request.resource_spans:
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        attrs = {a.key: _value(a.value) for a in span.attributes}
                        out[span.name] = (span.trace_id.hex(), attrs)
        return out

    def resource(self) -> dict[str, object]:
        _, _, request = self.received[0]
        return {a.key: _value(a.value) for a in request.resource_spans[0].resource.attributes}


def _value(value: object) -> object:
    kind = value.WhichOneof("value")  # type: ignore[attr-defined]
    if kind == "array_value":
        return tuple(_value(v) for v in value.array_value.values)  # type: ignore[attr-defined]
    return getattr(value, kind) if kind else None


@pytest.fixture
def collector() -> Iterator[FakeCollector]:
    got = FakeCollector(url="")

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["content-length"]))
            request = ExportTraceServiceRequest()
            request.ParseFromString(body)
            got.received.append((self.path, {k.lower(): v for k, v in self.headers.items()},
                                 request))  # fmt: skip
            answer = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    got.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield got
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


async def test_spans_are_exported_over_otlp_http(
    fake: FakeFactory, proxy: ProxyFactory, collector: FakeCollector
) -> None:
    p = await fake("P")
    d = await fake("D", cached_tokens=3)
    settings = quick_settings(
        [backend_entry(p, "producer"), backend_entry(d, "consumer")],
        tracing={
            "exporter_otlp_endpoint": collector.url,
            "exporter_otlp_headers": "x-tenant=team%20a",
            "service_name": "edge-proxy",
            "resource_attributes": "deployment.environment=test",
        },
    )
    assert settings.tracing.exporter == "otlp"
    px = await proxy(settings)
    async with px.client() as c:
        r = await c.post(
            "/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
            headers={"traceparent": TRACEPARENT},
        )
    assert r.status_code == 200
    # Stopping the proxy flushes the batch processor (its 5 s delay is not waited out).
    px.server.should_exit = True
    await px.task

    paths = {path for path, _, _ in collector.received}
    assert paths == {"/v1/traces"}
    assert all(h["x-tenant"] == "team a" for _, h, _ in collector.received)
    assert all(h["content-type"] == "application/x-protobuf" for _, h, _ in collector.received)
    spans = collector.spans()
    assert set(spans) == {"POST /v1/chat/completions", "route", "producer leg", "consumer leg"}
    assert {trace_id for trace_id, _ in spans.values()} == {TRACE}
    assert spans["consumer leg"][1]["pdproxy.cached_tokens"] == 3
    assert spans["producer leg"][1]["pdproxy.fleet.backends"] == ("P",)
    assert collector.resource()["service.name"] == "edge-proxy"
    assert collector.resource()["deployment.environment"] == "test"
    for leg in (*p.completions(), *d.completions()):
        sent = TraceParent.parse(leg.headers["traceparent"])
        assert sent is not None and sent.trace_id == TRACE


def test_tracing_off_imports_no_opentelemetry_sdk() -> None:
    """Off by default, at no cost: building the app and its request path loads none of the SDK
    (FastAPI itself may load the OpenTelemetry *API*; that is not ours to avoid)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    code = (
        "import sys\n"
        "from pdproxy.app import create_app\n"
        "from pdproxy.settings import ProxySettings\n"
        "app = create_app(ProxySettings())\n"
        "assert app.pdproxy_state.tracer is None\n"
        "bad = sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk', "
        "'opentelemetry.exporter', 'pdproxy.request.trace')))\n"
        "print(bad)\n"
    )
    command = [sys.executable, "-c", code]
    out = subprocess.run(command, check=False, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_env_turns_tracing_on_and_settings_win_over_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://collector:4318/v1/traces")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "from-env")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.25")
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")  # other signals' variables are ignored
    settings = ProxySettings()
    assert settings.tracing.enabled
    assert settings.tracing.traces_endpoint() == "http://collector:4318/v1/traces"
    assert settings.tracing.service_name == "from-env"
    assert settings.tracing.traces_sampler_arg == 0.25
    # The config file's (or CLI's) tracing map is layered over the environment.
    layered = ProxySettings(tracing={"service_name": "from-file"})
    assert layered.tracing.service_name == "from-file"
    assert layered.tracing.enabled
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert not ProxySettings().tracing.enabled


@pytest.mark.parametrize(
    ("env", "exporter"),
    [
        ({}, "none"),  # off by default
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, "none"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, "otlp"),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, "otlp"),  # to localhost:4318, as the spec says
        ({"OTEL_TRACES_EXPORTER": "console"}, "console"),
    ],
)
def test_which_exporter(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], exporter: str
) -> None:
    for name in list(os.environ):
        if name.startswith("OTEL_"):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    tracing = ProxySettings().tracing
    assert tracing.exporter == exporter
    if exporter == "otlp" and "OTEL_EXPORTER_OTLP_ENDPOINT" not in env:
        assert tracing.traces_endpoint() == "http://localhost:4318/v1/traces"


@pytest.mark.parametrize(
    "tracing",
    [
        {"exporter_otlp_protocol": "grpc"},  # only http/protobuf is installed
        {"traces_exporter": "zipkin"},
        {"traces_sampler": "sometimes"},
        {"traces_sampler_arg": 2},
        {"servce_name": "typo"},
    ],
)
def test_bad_tracing_settings_are_refused(tracing: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="tracing"):
        ProxySettings(tracing=tracing)


@pytest.mark.parametrize(
    "tracing",
    [{"exporter_otlp_headers": "no-equals-sign"}, {"resource_attributes": "a=1,=2"}],
)
def test_malformed_key_value_lists_are_refused(tracing: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="is not key=value"):
        ProxySettings(tracing=tracing)


@pytest.mark.slow
def test_bench_proxy_measures_tracing_against_the_same_tree_untraced() -> None:
    repo = str(Path(__file__).resolve().parents[3])
    done = subprocess.run(
        [sys.executable, "-m", "loadtest.bench_proxy", "--duration", "0.3",
         "--max-requests", "40", "--concurrency", "1", "--baseline-tree", repo, "--trace"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]  # a CI failure must say why
    out = done.stdout
    rows = [line for line in out.splitlines() if line.startswith(("nonstream", "stream64"))]
    assert len(rows) == 6 and all(line.split()[-1] == "0" for line in rows)
    exports = re.search(r"OTLP sink: (\d+) exports, (\d+) bytes", out)
    assert exports is not None and int(exports.group(1)) > 0 and int(exports.group(2)) > 0
