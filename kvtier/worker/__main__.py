"""``python -m kvtier.worker`` / ``kvtier-worker``: run one reference worker.

    python -m kvtier.worker --role both --model tiny --port 8100 --p2p-port 5600 \\
        --events-endpoint tcp://127.0.0.1:5557

SIGTERM/SIGINT stop it gracefully (exit status 0): no new requests, those in flight get
``--shutdown-timeout-s`` (default 5) to finish before they are aborted, then the P2P server,
supplies and event publisher are closed.

Settings come from (highest first) flags, ``--config FILE.yaml``, ``KVTIER_WORKER_*`` env vars.
A settings error names the field and the rule, never the value (it may be a secret).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError

from kvtier.heap import freeze_startup_heap
from kvtier.worker.server.app import create_app
from kvtier.worker.server.graceful import serve_worker
from kvtier.worker.settings import WorkerSettings, settings_error_text

_FLAGS: dict[str, dict[str, Any]] = {
    "role": {"choices": ["producer", "consumer", "both"]},
    "model": {"choices": ["tiny", "sim"]},
    "served-model-name": {},
    "host": {},
    "port": {"type": int},
    "advertise-host": {},
    "p2p-port": {"type": int},
    "events-endpoint": {},
    "events-replay-endpoint": {},
    "engine-id": {},
    "device": {},
    "num-pages": {"type": int},
    "host-pages": {"type": int},
    "max-model-len": {"type": int},
    "max-running": {"type": int},
    "max-batched-tokens": {"type": int},
    "model-seed": {"type": int},
    "lora-modules": {
        "action": "append",
        "dest": "lora_modules",
        "help": "LoRA adapter served as a model name: NAME or NAME=PATH (repeatable)",
    },
    "max-loras": {"type": int},
    "sliding-window": {"type": int},
    "dtype": {"choices": ["float64", "float32"]},
    "sim-prefill-ms-per-token": {"type": float},
    "sim-decode-ms-per-step": {"type": float},
    "fetch-timeout-s": {"type": float},
    "supply-lease-s": {"type": float},
    "torch-threads": {"type": int},
    "shutdown-timeout-s": {"type": float},
    "api-key": {"help": "bearer key for the API (prefer KVTIER_WORKER_API_KEY: argv is public)"},
    "max-body-bytes": {"type": int},
    "p2p-allowed-peer": {
        "action": "append",
        "dest": "p2p_allowed_peers",
        "help": "producer a consumer leg may name: host, host:port, CIDR or * (repeatable)",
    },
    "events-curve-secret-key-file": {"type": Path},
    "events-curve-clients-dir": {"type": Path},
    "announce-endpoint": {"help": "proxy registration endpoint, e.g. tcp://proxy:30001"},
    "announce-curve-secret-key-file": {"type": Path},
    "announce-curve-server-key-file": {"type": Path},
    "announce-interval-s": {"type": float},
    "announce-name": {},
    "data-parallel-size": {"type": int, "help": "engines (DP ranks) behind this endpoint"},
    "p2p-holder": {
        "action": argparse.BooleanOptionalAction,
        "help": "answer P2P offers (remote_kv_source) from this node's KV, any role "
        "(default: on; a consumer then listens on --p2p-port)",
    },
}


def parse_settings(argv: list[str] | None = None) -> tuple[WorkerSettings, str]:
    parser = argparse.ArgumentParser(
        prog="kvtier-worker",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", type=Path, help="YAML file of settings")
    parser.add_argument("--log-level", default="info")
    for flag, kwargs in _FLAGS.items():
        parser.add_argument(f"--{flag}", default=None, **kwargs)
    args = vars(parser.parse_args(argv))
    config: Path | None = args.pop("config")
    log_level: str = args.pop("log_level")
    overrides = {k: v for k, v in args.items() if v is not None}
    if config is not None:
        return WorkerSettings.from_file(config, **overrides), log_level
    return WorkerSettings(**overrides), log_level


def main(argv: list[str] | None = None) -> None:
    try:
        settings, log_level = parse_settings(argv)
    except ValidationError as exc:
        sys.exit(f"kvtier-worker: invalid settings: {settings_error_text(exc)}")
    except (OSError, ValueError) as exc:  # the config file: unreadable, not YAML, not a mapping
        sys.exit(f"kvtier-worker: invalid settings: {exc}")
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if settings.torch_threads > 0:
        torch.set_num_threads(settings.torch_threads)
    app = create_app(settings)
    freeze_startup_heap()
    print(
        f"kvtier worker: role={settings.role} model={settings.model} "
        f"http://{settings.host}:{settings.port}",
        flush=True,
    )
    if serve_worker(app, settings, log_level):
        # Stopped cleanly: the app's lifespan has closed everything the worker owns. What is
        # left is the interpreter freeing torch's and every module's objects one by one, which
        # took tens of seconds on a loaded machine, the process seemingly hung after "Finished
        # server process" (past a supervisor's stop bound): skip it.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
