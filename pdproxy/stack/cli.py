"""``pdproxy up`` / ``python -m pdproxy.stack``: a local PD cluster in one command.

Starts N producer and M consumer engines (kvtier reference workers, or real vLLM with
``--engine vllm``) and a proxy in front of them (KV-aware
router, residency in memory or Redis, KV events wired), waits until all are healthy, prints the
endpoint and a ``curl`` line, shows live status, and on Ctrl-C or SIGTERM stops every process
it started.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

from pdproxy.stack.display import StatusBoard, ready_banner
from pdproxy.stack.errors import StackError
from pdproxy.stack.plan import (
    StackDialect,
    StackOptions,
    StackPlan,
    WorkerModel,
    admin_key_path,
    build_plan,
    model_name,
    write_proxy_config,
)
from pdproxy.stack.proxy_view import ProxyBackendsView
from pdproxy.stack.supervisor import ProcessStatus, Supervisor
from pdproxy.stack.vllm_engine import VllmConnector, VllmPaths
from pdproxy.stack.vllm_plan import build_vllm_plan

DESCRIPTION = __doc__.split("\n\n")[1] if __doc__ else ""


def add_up_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--engine",
        choices=["worker", "vllm"],
        default="worker",
        help="worker: kvtier reference workers; vllm: real vLLM (CPU) with NIXL, set up by "
        "`scripts/dev vllm-setup`",
    )
    parser.add_argument(
        "--connector",
        choices=[c.value for c in VllmConnector],
        default=VllmConnector.NIXL.value,
        help="with --engine vllm: the KV connector between producers and consumers: nixl "
        "(vLLM's NixlConnector, proxy in the nixl dialect) or kvtier (kvtier.vllm's "
        "KvtierConnector over kvtier P2P, proxy in the p2p dialect)",
    )
    parser.add_argument("--vllm-venv", type=Path, default=None, metavar="DIR",
                        help="vLLM's venv (PDPROXY_VLLM_VENV, else ./.venv-vllm)")  # fmt: skip
    parser.add_argument("--vllm-model", type=Path, default=None, metavar="DIR",
                        help="model dir (PDPROXY_VLLM_MODEL_DIR, else in the venv)")  # fmt: skip
    parser.add_argument("--producers", type=int, default=1, help="producer workers (1)")
    parser.add_argument("--consumers", type=int, default=1, help="consumer workers (1)")
    parser.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                        help="data-parallel ranks per worker (1), routed per rank")  # fmt: skip
    parser.add_argument(
        "--model",
        choices=[m.value for m in WorkerModel],
        default=WorkerModel.TINY.value,
        help="worker compute backend: tiny (a real small transformer) or sim (for load)",
    )
    parser.add_argument(
        "--models",
        default=None,
        metavar="A,B",
        help="serve these model names, each with its own producers and consumers, routed by "
        "model (one KV router per model)",
    )
    parser.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="ADAPTER[@MODEL]",
        help="LoRA adapter served by every worker of MODEL (default: the first model); "
        "repeatable. With --engine vllm: an adapter made from a seed for the tiny model, loaded "
        "with --enable-lora",
    )
    parser.add_argument(
        "--dialect",
        choices=[d.value for d in StackDialect],
        default=StackDialect.P2P.value,
        help="kv_transfer_params dialect between proxy and workers",
    )
    parser.add_argument(
        "--router",
        choices=["kv", "round_robin", "least_loaded"],
        default="kv",
        help="proxy router (kv: KV-aware, fed by the workers' KV events)",
    )
    parser.add_argument("--sim-prefill-ms-per-token", type=float, default=None, metavar="MS",
                        help="sim workers: prefill latency per prompt token")  # fmt: skip
    parser.add_argument("--sim-decode-ms-per-step", type=float, default=None, metavar="MS",
                        help="sim workers: latency of one decode step")  # fmt: skip
    parser.add_argument("--redis", default=None, metavar="URL", help="Redis residency index")
    parser.add_argument("--host", default="127.0.0.1", help="proxy listen address")
    parser.add_argument("--port", type=int, default=8000, help="proxy port (8000)")
    parser.add_argument("--run-dir", type=Path, default=None, help="config and logs (a temp dir)")
    parser.add_argument("--startup-timeout", type=float, default=None, metavar="S",
                        help="seconds to become healthy (120; 600 with --engine vllm)")  # fmt: skip
    parser.add_argument("--status-interval", type=float, default=2.0, metavar="S",
                        help="seconds between status updates (0: none)")  # fmt: skip
    parser.add_argument("--ready-file", type=Path, default=None,
                        help="write endpoint and PIDs here as JSON once healthy")  # fmt: skip
    parser.add_argument("--worker-arg", action="append", default=[], metavar="ARG",
                        help="extra worker flag (repeatable: --worker-arg=--x)")  # fmt: skip
    parser.add_argument("--proxy-arg", action="append", default=[], metavar="ARG",
                        help="extra flag for the proxy (repeatable)")  # fmt: skip


def add_up_command(subparsers: Any) -> None:
    """Register ``up`` on a CLI's subparsers; the parsed namespace's ``handler`` runs it."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "up", help="run a local PD stack (proxy + workers)", description=DESCRIPTION
    )
    add_up_arguments(parser)
    parser.set_defaults(handler=run_up)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pdproxy.stack", description=DESCRIPTION)
    add_up_arguments(parser)
    return parser


def options_from_args(args: argparse.Namespace) -> StackOptions:
    worker_args = list(args.worker_arg)
    if args.sim_prefill_ms_per_token is not None:
        worker_args += ["--sim-prefill-ms-per-token", str(args.sim_prefill_ms_per_token)]
    if args.sim_decode_ms_per_step is not None:
        worker_args += ["--sim-decode-ms-per-step", str(args.sim_decode_ms_per_step)]
    models = tuple(m.strip() for m in (args.models or "").split(",") if m.strip())
    first = models[0] if models else model_name(WorkerModel(args.model))
    lora = tuple(
        (adapter, model or first) for adapter, _, model in (x.partition("@") for x in args.lora)
    )
    return StackOptions(
        models=models,
        lora=lora,
        producers=args.producers,
        consumers=args.consumers,
        model=WorkerModel(args.model),
        dialect=StackDialect(args.dialect),
        redis_url=args.redis,
        host=args.host,
        port=args.port,
        worker_args=tuple(worker_args),
        proxy_args=tuple(args.proxy_arg),
        router=args.router,
        data_parallel_size=args.data_parallel_size,
    )


@contextmanager
def stop_on_signals(stop: threading.Event) -> Iterator[None]:
    def handler(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # HUP: the terminal closed
    previous = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def serve_stack(
    plan: StackPlan,
    log_dir: Path,
    *,
    stop: threading.Event,
    startup_timeout_s: float,
    status_interval_s: float,
    ready_file: Path | None,
    out: TextIO,
    stop_grace_s: float = 10.0,
) -> int:
    """Run the planned stack until ``stop`` is set or a process dies; always stop everything.

    Workers start first; the proxy starts once they are healthy, so it never begins with
    every backend ejected."""
    view = ProxyBackendsView(plan.endpoint, plan.admin_key) if plan.admin_key else None
    with Supervisor(log_dir, stop_grace_s=stop_grace_s) as supervisor:
        try:
            _say(out, f"starting {len(plan.workers)} workers (logs in {log_dir}) ...\n")
            supervisor.start(plan.workers)
            supervisor.wait_healthy(startup_timeout_s, stop)
            _say(out, f"workers healthy; starting the proxy on {plan.endpoint} ...\n")
            supervisor.start([plan.proxy])
            supervisor.wait_healthy(startup_timeout_s, stop)
            statuses = supervisor.statuses()
            banner = ready_banner(
                plan.endpoint,
                plan.model_name,
                str(log_dir),
                statuses,
                str(admin_key_path(plan)) if plan.admin_key else "",
            )
            _say(out, banner)
            if ready_file is not None:
                ready = {
                    "endpoint": plan.endpoint,
                    "model": plan.model_name,
                    "models": list(plan.models or (plan.model_name,)),
                    "pids": {s.name: s.pid for s in statuses},
                }
                ready_file.write_text(json.dumps(ready))
            board = StatusBoard(out, redraw=out.isatty())
            while not stop.is_set():
                supervisor.check_running()
                if status_interval_s > 0:
                    board.show(_with_proxy_view(supervisor.statuses(), view))
                stop.wait(status_interval_s if status_interval_s > 0 else 1.0)
            code = 0
        except StackError as exc:
            if stop.is_set():  # Ctrl-C while starting: not an error
                code = 0
            else:
                _say(out, f"\nerror: {exc}\n")
                code = 1
        finally:
            _say(out, "stopping ...\n")
            exits = supervisor.stop()
            for info in exits:
                how = "killed" if info.killed else f"exit {info.returncode}"
                _say(out, f"  {info.name:<12} pid {info.pid:<8} {how}\n")
            if view is not None:
                view.close()
    return code


def _say(out: TextIO, text: str) -> None:
    """Write to the terminal; a closed terminal (hang-up) must not stop the clean-up."""
    try:
        out.write(text)
        out.flush()
    except OSError:
        pass


def _with_proxy_view(
    statuses: list[ProcessStatus], view: ProxyBackendsView | None
) -> list[ProcessStatus]:
    """Workers' status lines carry what the proxy sees of them (in flight, routable)."""
    details = view.details() if view is not None else {}
    return [
        dataclasses.replace(s, detail=details[s.name]) if s.running and s.name in details else s
        for s in statuses
    ]


def run_up(args: argparse.Namespace) -> int:
    options = options_from_args(args)
    if not _port_is_free(options.host, options.port):
        print(f"error: port {options.port} on {options.host} is in use; pass --port", flush=True)
        return 2
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="pdproxy-up-"))  # mode 0700
    run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        if args.engine == "vllm":
            paths = VllmPaths.resolve(args.vllm_venv, args.vllm_model)
            plan = build_vllm_plan(options, paths, run_dir, connector=VllmConnector(args.connector))
        else:
            plan = build_plan(options, run_dir)
    except ValueError as exc:
        print(f"error: {exc}", flush=True)
        return 2
    write_proxy_config(plan)
    stop = threading.Event()
    with stop_on_signals(stop):
        return serve_stack(
            plan,
            run_dir / "logs",
            stop=stop,
            startup_timeout_s=args.startup_timeout or (600.0 if args.engine == "vllm" else 120.0),
            status_interval_s=args.status_interval,
            ready_file=args.ready_file,
            out=sys.stdout,
            # vLLM takes longer than the reference worker to shut its engine and NIXL down.
            stop_grace_s=15.0 if args.engine == "vllm" else 10.0,
        )


def main(argv: Sequence[str] | None = None) -> int:
    return run_up(build_parser().parse_args(argv))
