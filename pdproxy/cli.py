"""The ``pdproxy`` command.

``pdproxy serve --config proxy.yaml [--host H] [--port N] [--producer URL] [--consumer URL]
[--router NAME] [--index redis://...] [--workers N]`` runs the proxy under uvicorn (uvloop,
httptools, no access log), in N processes on the one port (default one per core). Settings
come from the config file, then ``PDPROXY_*`` environment variables, then these flags (highest
priority).

Subcommands are registered by functions in :data:`COMMANDS`; each adds its subparser and sets
``handler`` (``args -> exit status``) with ``set_defaults``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import socket
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn
from pydantic import ValidationError

from pdproxy.app import ProxyState, create_app, proxy_state
from pdproxy.errors import ConfigError
from pdproxy.front.protocol import gated_protocol
from pdproxy.serve.process_group import ProcessGroup, process_count
from pdproxy.serve.siblings import Siblings
from pdproxy.settings import ProxySettings, validation_error_text
from pdproxy.stack import add_up_command

log = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    """uvicorn that, on SIGTERM/SIGINT, first turns readiness false (``drain_delay_s``),
    then stops accepting and lets in-flight requests finish (``drain_timeout_s``)."""

    def __init__(self, config: uvicorn.Config, state: ProxyState) -> None:
        super().__init__(config)
        self._state = state

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """As uvicorn's, minus re-raising the signal afterwards: a drained exit is status 0."""
        with super().capture_signals():
            try:
                yield
            finally:
                self._captured_signals.clear()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        delay = self._state.settings.drain_delay_s
        if self._state.draining or delay <= 0 or sig != signal.SIGTERM:
            self._state.begin_drain()
            super().handle_exit(sig, frame)
            return
        self._state.begin_drain()
        loop = asyncio.get_event_loop()
        loop.call_soon_threadsafe(loop.call_later, delay, super().handle_exit, sig, frame)


def settings_from_args(args: argparse.Namespace) -> ProxySettings:
    overrides: dict[str, Any] = {}
    if args.config is not None:
        overrides["config_file"] = args.config
    for name in ("host", "port", "router", "log_level", "workers"):
        value = getattr(args, name)
        if value is not None:
            overrides[name] = value
    backends = [
        {"name": f"producer-{i}", "url": url, "role": "producer", "dialect": args.dialect}
        for i, url in enumerate(args.producer or [])
    ] + [
        {"name": f"consumer-{i}", "url": url, "role": "consumer", "dialect": args.dialect}
        for i, url in enumerate(args.consumer or [])
    ]
    if backends:
        overrides["backends"] = backends
    if args.index is not None:
        if args.router not in (None, "kv"):
            raise ConfigError(f"--index needs the KV router, not --router {args.router}")
        if not args.index.startswith(_INDEX_SCHEMES):
            # The URL may hold a password: name the rule, not the value.
            raise ConfigError(f"--index must start with one of {_INDEX_SCHEMES}")
        overrides["router"] = "kv"
        overrides["router_options"] = {"index_url": args.index}  # merged into the file's
    return ProxySettings(**overrides)


_INDEX_SCHEMES = ("redis://", "rediss://", "unix://")


def _configure_logging(settings: ProxySettings) -> None:
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s",
    )


def run_server(settings: ProxySettings) -> int:
    """Serve until SIGTERM/SIGINT: one process, or ``settings.workers`` (0: one per core)
    processes on one port (:mod:`pdproxy.serve.process_group`). Returns the exit status."""
    _configure_logging(settings)
    # One salt secret for every process of the group: a tenant's requests hash alike whichever
    # process takes them.
    settings = settings.model_copy(update={"tenants": settings.tenants.with_secret()})
    count = process_count(settings.workers)
    if count > 1 and settings.membership.registration.listens:
        # One ROUTER socket per endpoint, and each process would hold only the registrations
        # that reached it: a worker group cannot share one registration listener.
        if settings.workers > 1:
            raise ConfigError(
                "membership.registration needs workers: 1 (one process owns the registration "
                "socket and the backends it announces)"
            )
        log.warning("membership.registration is set: serving with one process, not %d", count)
        count = 1
    if count == 1:
        serve_process(settings)
        return 0
    return ProcessGroup(settings, count, serve_process).run()


def serve_process(
    settings: ProxySettings,
    sockets: list[socket.socket] | None = None,
    siblings: Siblings | None = None,
) -> None:
    """One proxy process under uvicorn: on ``settings.host:port``, or on ``sockets``."""
    app = create_app(settings, siblings=siblings)
    state = proxy_state(app)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        # Connection limits, head deadline and size: the protocol's gate, not limit_concurrency
        # (which counted silent sockets against the cap of requests in progress).
        # The hot routes answered without the ASGI cycle (pdproxy.front.direct).
        http=gated_protocol(state.connections, hot=state.request_path),
        access_log=False,
        proxy_headers=False,
        server_header=False,
        log_level=settings.log_level,
        timeout_graceful_shutdown=int(settings.drain_timeout_s) or None,
        lifespan="on",
    )
    DrainingServer(config, state).run(sockets=sockets)


def _serve(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args)
    except ConfigError as exc:
        print(f"pdproxy: invalid configuration: {exc}", file=sys.stderr)
        return 2
    except ValidationError as exc:
        print(f"pdproxy: invalid configuration: {validation_error_text(exc)}", file=sys.stderr)
        return 2
    try:
        return run_server(settings)
    except ConfigError as exc:
        print(f"pdproxy: invalid configuration: {exc}", file=sys.stderr)
        return 2


def add_serve_command(subparsers: Any) -> None:
    serve = subparsers.add_parser("serve", help="run the proxy")
    serve.add_argument("--config", type=Path, help="YAML or JSON settings file")
    serve.add_argument("--host", help="listen address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="listen port (default 8000)")
    serve.add_argument("--router", choices=["round_robin", "least_loaded", "kv"])
    serve.add_argument(
        "--index", metavar="URL",
        help="shared residency index for the KV router (redis://host:6379/0): sets "
        "router_options.index_url and implies --router kv (any other --router is an error)",
    )  # fmt: skip
    serve.add_argument(
        "--producer", action="append", metavar="URL", help="producer backend (repeatable)"
    )
    serve.add_argument(
        "--consumer", action="append", metavar="URL", help="consumer backend (repeatable)"
    )
    serve.add_argument(
        "--dialect", choices=["nixl", "p2p", "none"], default="nixl",
        help="dialect of --producer/--consumer backends (default nixl)",
    )  # fmt: skip
    serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    serve.add_argument(
        "--workers", type=int, metavar="N",
        help="proxy processes on the one port (default: one per core; 1: this process only)",
    )  # fmt: skip
    serve.set_defaults(handler=_serve)


COMMANDS: list[Callable[[Any], None]] = [add_serve_command, add_up_command]
"""Subcommand registrars; each receives the subparsers object."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdproxy", description="OpenAI-compatible prefill/decode disaggregation proxy"
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    for register in COMMANDS:
        register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
