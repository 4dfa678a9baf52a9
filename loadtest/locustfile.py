"""Locust load test for OpenAI endpoints (through pdproxy or straight at an engine).

    locust -f loadtest/locustfile.py --headless -u 8 -r 8 -t 30s --host http://127.0.0.1:8000 \\
        --workload shared-prefix --groups 4 --prompts-per-group 8 --report-json report.json

Every flag also reads ``LOCUST_<FLAG>`` from the environment (``LOCUST_WORKLOAD=multi-turn``).
Streams are read line by line and timed per SSE chunk; TTFT, ITL and TPOT are fired as custom
``METRIC`` events (so Locust's table shows them), each request's Locust time is its end-to-end
latency, failures are named by class (``http_5xx``, ``truncated``, ``stream_error``, ...). At
the end the exact percentiles over every raw sample (Locust rounds its own) are printed as
vLLM's table and written to ``--report-json``; in a distributed run (``--processes N`` or
master/workers) each worker sends its raw samples to the master, which reports over all.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from locust import FastHttpUser, constant, events, task
from locust.env import Environment
from locust.runners import MasterRunner, WorkerRunner

# Locust puts this file's folder on sys.path, not the repository root that holds the package.
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from loadtest import workloads  # noqa: E402
from loadtest.model_discovery import served_model  # noqa: E402
from loadtest.serving_metrics import format_table, parse_slos, summarize  # noqa: E402
from loadtest.stream_timing import (  # noqa: E402
    ErrorKind,
    RequestRecord,
    SSEDecoder,
    StreamTimer,
    classify_status,
    failed,
    record_from_json,
)


class LoadState:
    """Raw samples and the session supply of one Locust process."""

    def __init__(self, config: workloads.WorkloadConfig) -> None:
        self.config = config
        self.records: list[RequestRecord] = []
        self.t0 = time.perf_counter()
        self.t_end: float | None = None
        self.reported = False
        self._sessions = self._cycle()

    def _cycle(self) -> Iterator[workloads.Session]:
        """The workload's sessions, again and again (each pass with the next seed)."""
        n = 0
        while True:
            options = dataclasses.replace(self.config.options, seed=self.config.options.seed + n)
            config = dataclasses.replace(self.config, options=options)
            yield from workloads.sessions(config)
            n += 1

    def next_session(self) -> workloads.Session:
        return next(self._sessions)


_hooks: Any = events  # Locust's event hooks are untyped


def _options(environment: Environment) -> argparse.Namespace:
    options: argparse.Namespace | None = environment.parsed_options
    if options is None:
        raise RuntimeError("run this file with the locust command")
    return options


def _add_arguments(parser: Any) -> None:
    workloads.add_workload_arguments(parser, env_prefix="LOCUST_")
    parser.add_argument("--report-json", env_var="LOCUST_REPORT_JSON", default="")
    parser.add_argument(
        "--report-plots", env_var="LOCUST_REPORT_PLOTS", action="store_true", default=False,
        help="also write PNG plots next to --report-json (needs matplotlib)",
    )  # fmt: skip
    parser.add_argument("--metric-percentiles", env_var="LOCUST_METRIC_PERCENTILES", default="99")
    parser.add_argument("--goodput", env_var="LOCUST_GOODPUT", default="", help="ttft:500,...")
    parser.add_argument("--api-key", env_var="LOCUST_API_KEY", default="")


def _on_test_start(environment: Environment, **_: Any) -> None:
    options = _options(environment)
    if not options.model:
        options.model = served_model(str(environment.host), options.api_key or None)
    OpenAIUser.state = LoadState(workloads.config_from_arguments(options))


RECORDS_MESSAGE = "pd_request_records"
"""Worker → master: a worker's raw request records at the end of a distributed run."""


def _to_wire(record: RequestRecord) -> dict[str, Any]:
    doc = dataclasses.asdict(record)
    doc["error"] = None if record.error is None else record.error.value
    doc["itl_s"] = list(record.itl_s)
    return doc


def _from_wire(doc: dict[str, Any]) -> RequestRecord:
    error = doc.get("error")
    fields = {**doc, "error": None if error is None else ErrorKind(error)}
    fields["itl_s"] = tuple(doc.get("itl_s") or ())
    return RequestRecord(**fields)


def _on_init(environment: Environment, **_: Any) -> None:
    if isinstance(environment.runner, MasterRunner):

        def receive(msg: Any, **_: Any) -> None:
            state = OpenAIUser.state
            if state is not None:
                state.records.extend(_from_wire(doc) for doc in msg.data["records"])

        environment.runner.register_message(RECORDS_MESSAGE, receive)


def _on_test_stop(environment: Environment, **_: Any) -> None:
    state = OpenAIUser.state
    if state is None or state.t_end is not None:
        return
    state.t_end = time.perf_counter()
    if isinstance(environment.runner, WorkerRunner):
        # The master summarizes every worker's raw samples. Workers stop (and send) before
        # their final stats report, which the master waits for before it quits.
        records = [_to_wire(r) for r in state.records]
        environment.runner.send_message(RECORDS_MESSAGE, {"records": records})
        return
    if isinstance(environment.runner, MasterRunner):
        return  # workers' records may still be in flight: report when quitting
    _report(environment, state)


def _on_quitting(environment: Environment, **_: Any) -> None:
    state = OpenAIUser.state
    if isinstance(environment.runner, MasterRunner) and state is not None and not state.reported:
        _report(environment, state)


def _report(environment: Environment, state: LoadState) -> None:
    state.reported = True
    t_end = state.t_end if state.t_end is not None else time.perf_counter()
    options = _options(environment)
    percentiles = [float(p) for p in str(options.metric_percentiles).split(",") if p.strip()]
    slos = parse_slos(s for s in str(options.goodput).split(",") if s.strip())
    result = summarize(state.records, t_end - state.t0, percentiles, slos)
    result["workload"] = state.config.kind.value
    result["model_id"] = state.config.options.model
    result["generator"] = "locust"
    print(format_table(result, percentiles), flush=True)
    if options.report_json:
        Path(options.report_json).write_text(json.dumps(result, indent=2))
        if options.report_plots:
            from loadtest.plots import plot_result  # matplotlib only when asked for

            for path in plot_result(Path(options.report_json)):
                print(f"wrote {path}", flush=True)


_hooks.init_command_line_parser.add_listener(_add_arguments)
_hooks.init.add_listener(_on_init)
_hooks.quitting.add_listener(_on_quitting)
_hooks.test_start.add_listener(_on_test_start)
_hooks.test_stop.add_listener(_on_test_stop)


def _fire_metric(environment: Environment, name: str, seconds: float) -> None:
    hooks: Any = environment.events
    hooks.request.fire(
        request_type="METRIC",
        name=name,
        response_time=seconds * 1000,
        response_length=0,
        exception=None,
        context={},
    )


class OpenAIUser(FastHttpUser):
    """Runs workload sessions back to back: one session (a prompt or a chat) at a time."""

    wait_time = constant(0)
    network_timeout = 300.0
    connection_timeout = 10.0
    state: LoadState | None = None

    def on_start(self) -> None:
        self._session: workloads.Session | None = None

    @task
    def run_turn(self) -> None:
        state = OpenAIUser.state
        if state is None:
            return
        if self._session is None:
            self._session = state.next_session()
        spec = self._session.next_request()
        if spec is None:
            self._session = None
            return
        record = self._send(spec, state.t0)
        state.records.append(record)
        if record.ok:
            if record.ttft_s is not None:
                _fire_metric(self.environment, "TTFT", record.ttft_s)
            for gap in record.itl_s:
                _fire_metric(self.environment, "ITL", gap)
            if record.tpot_s is not None:
                _fire_metric(self.environment, "TPOT", record.tpot_s)
        self._session.record_answer(record.text)

    def _send(self, spec: workloads.RequestSpec, t0: float) -> RequestRecord:
        headers = {"Content-Type": "application/json"}
        api_key = _options(self.environment).api_key
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        start = time.perf_counter()
        name = f"{spec.endpoint} {'stream' if spec.stream else 'json'}"
        with self.client.post(
            spec.endpoint,
            json=spec.body,
            headers=headers,
            stream=spec.stream,
            catch_response=True,
            name=name,
        ) as resp:
            record = self._read(resp, spec, start)
            resp.request_meta["response_time"] = record.e2el_s * 1000
            if record.ok:
                resp.success()
            else:
                resp.failure(str(record.error))
        return dataclasses.replace(record, start_s=start - t0)

    def _read(self, resp: Any, spec: workloads.RequestSpec, start: float) -> RequestRecord:
        status = int(resp.status_code)
        if status == 0:
            error = getattr(resp, "error", None)
            kind = ErrorKind.TIMEOUT if "timeout" in repr(error).lower() else ErrorKind.CONNECT
            return failed(spec.tag, start, time.perf_counter(), kind, repr(error))
        kind_or_none = classify_status(status)
        if kind_or_none is not None:
            text = resp.text or ""
            return failed(spec.tag, start, time.perf_counter(), kind_or_none, text)
        if not spec.stream:
            body = resp.content or b""
            return record_from_json(spec.tag, start, time.perf_counter(), body, spec.prompt_len)
        timer = StreamTimer(spec.tag, start, spec.prompt_len)
        decoder = SSEDecoder()
        raw = resp._response
        try:
            while raw is not None:
                line = raw.readline(b"\n")
                now = time.perf_counter()
                if not line:
                    break
                for payload in decoder.feed(line):
                    timer.on_payload(payload, now)
        except Exception as exc:  # gevent/socket errors mid-stream: the stream was cut
            return failed(spec.tag, start, time.perf_counter(), ErrorKind.TRUNCATED, repr(exc))
        now = time.perf_counter()
        for payload in decoder.flush():
            timer.on_payload(payload, now)
        return timer.finish(now)
