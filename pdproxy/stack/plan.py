"""What the local stack runs: worker and proxy commands, ports and the proxy's config.

Pure: builds :class:`ProcessSpec` values and the proxy config mapping from the options and a
port source; starting them is the supervisor's job. Workers publish KV events on their own
ZMQ endpoint; the proxy's KV-aware router subscribes to every one of them and keeps residency
in memory (or in Redis with ``redis_url``).

Secrets are fresh per run: the P2P secret, the proxy's admin key, and the workers' API key,
which every worker gets in its environment (``KVTIER_WORKER_API_KEY``, never on its command
line, which other local users can read) and the proxy as each backend's ``api_key``. The config
holding them is written 0600 (:func:`write_proxy_config`).

With ``models`` (``pdproxy up --models a,b``) every model gets its own producers and consumers
(workers serving it under that name), each backend lists its models (and LoRA adapters, from
``lora``) in the proxy config, and the proxy routes by model with one KV router per model.
"""

from __future__ import annotations

import re
import secrets
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import yaml

from kvtier.private_file import write_private_text
from pdproxy.stack.ports import free_port, free_port_run
from pdproxy.stack.process import ProcessSpec

PortSource = Callable[[], int]


class WorkerModel(StrEnum):
    TINY = "tiny"
    SIM = "sim"


class StackDialect(StrEnum):
    P2P = "p2p"
    NIXL = "nixl"


BLOCK_SIZE = 16
"""The reference worker's default block size; the router hashes prompts with the same."""


@dataclass(frozen=True, slots=True)
class StackOptions:
    producers: int = 1
    consumers: int = 1
    model: WorkerModel = WorkerModel.TINY
    dialect: StackDialect = StackDialect.P2P
    redis_url: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    python: str = sys.executable
    worker_args: tuple[str, ...] = ()
    """Extra flags passed to every worker (e.g. ``--sim-decode-ms-per-step 5``)."""
    proxy_args: tuple[str, ...] = ()
    router: str = "kv"
    """The proxy's router; ``kv`` (KV-aware, fed by the workers' events) unless told otherwise."""
    models: tuple[str, ...] = ()
    """Served model names, each with its own producers and consumers (empty: one model, named
    after the worker backend)."""
    lora: tuple[tuple[str, str], ...] = ()
    """(adapter, model): LoRA adapters loaded on every worker of that model."""
    data_parallel_size: int = 1
    """Data-parallel ranks per worker (vLLM's ``--data-parallel-size``; the reference worker
    has the same): each rank its own engine and KV cache, the proxy routing per rank."""


@dataclass(frozen=True, slots=True)
class StackPlan:
    options: StackOptions
    workers: tuple[ProcessSpec, ...]
    proxy: ProcessSpec
    proxy_config: dict[str, Any]
    config_path: Path
    endpoint: str
    model_name: str
    """The first (or only) model served."""
    events: dict[str, str] = field(default_factory=dict)
    """Worker name → the ZMQ endpoint its KV events are published on."""
    admin_key: str = ""
    """The proxy's admin API key (a fresh random one per stack; the status board uses it)."""
    worker_key: str = ""
    """The workers' API key (fresh per stack); the proxy sends it to every backend."""
    models: tuple[str, ...] = ()
    """Every model and adapter the stack serves."""

    @property
    def specs(self) -> tuple[ProcessSpec, ...]:
        """Workers first, proxy last (the supervisor stops in reverse: proxy first)."""
        return (*self.workers, self.proxy)


def model_name(model: WorkerModel) -> str:
    """The name the reference worker serves (``WorkerSettings.model_name``'s default)."""
    return f"kvtier-{model.value}"


def _url_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "") else host


def proxy_process(options: StackOptions, config_path: Path, url_host: str) -> ProcessSpec:
    """``pdproxy serve`` on the stack's config; healthy once ``/ready`` answers (any engine)."""
    argv = (
        options.python, "-m", "pdproxy.cli", "serve",
        "--config", str(config_path),
        "--host", options.host,
        "--port", str(options.port),
        *options.proxy_args,
    )  # fmt: skip
    return ProcessSpec(
        name="proxy",
        argv=argv,
        health_url=f"http://{url_host}:{options.port}/ready",
        role="proxy",
    )


_UNSAFE_NAME = re.compile(r"[^A-Za-z0-9._-]")


def _check_models(options: StackOptions) -> None:
    if len(set(options.models)) != len(options.models):
        raise ValueError("--models names a model twice")
    for adapter, model in options.lora:
        if model not in (options.models or (model_name(options.model),)):
            raise ValueError(f"LoRA adapter {adapter!r}: no model {model!r} in the stack")
        if adapter in options.models:
            raise ValueError(f"LoRA adapter {adapter!r} has a model's name")


def build_plan(options: StackOptions, run_dir: Path, ports: PortSource = free_port) -> StackPlan:
    if options.producers < 1 or options.consumers < 1:
        raise ValueError("a PD stack needs at least one producer and one consumer")
    if options.data_parallel_size < 1:
        raise ValueError("--data-parallel-size must be at least 1")
    _check_models(options)
    host = _url_host(options.host)
    secret = secrets.token_hex(16)
    admin_key = secrets.token_hex(16)
    worker_key = secrets.token_hex(16)
    name = options.models[0] if options.models else model_name(options.model)
    workers: list[ProcessSpec] = []
    backends: list[dict[str, Any]] = []
    events: dict[str, str] = {}
    roles = [("producer", i) for i in range(options.producers)]
    roles += [("consumer", i) for i in range(options.consumers)]
    served = options.models or (None,)
    units = [(m, role, i) for m in served for role, i in roles]
    for served_name, role, i in units:
        worker = f"{role[0]}{i}"  # p0, p1, ..., c0, c1, ...
        model_args: tuple[str, ...] = ()
        if served_name is not None:
            worker = f"{_UNSAFE_NAME.sub('-', served_name)[:48]}-{worker}"
            model_args = ("--served-model-name", served_name)
        adapters = [a for a, m in options.lora if m == (served_name or name)]
        for adapter in adapters:
            model_args += ("--lora-modules", adapter)
        http_port = ports()
        dp = options.data_parallel_size
        # Rank r publishes on these ports + r: runs of free ports for several ranks.
        events_endpoint = f"tcp://127.0.0.1:{ports() if dp == 1 else free_port_run(dp)}"
        replay_endpoint = f"tcp://127.0.0.1:{ports() if dp == 1 else free_port_run(dp)}"
        if dp > 1:
            model_args += ("--data-parallel-size", str(dp))
        argv = (
            options.python, "-m", "kvtier.worker",
            "--role", role,
            "--model", options.model.value,
            "--host", "127.0.0.1",
            "--port", str(http_port),
            "--events-endpoint", events_endpoint,
            "--events-replay-endpoint", replay_endpoint,
            "--engine-id", worker,
            *model_args,
            *options.worker_args,
        )  # fmt: skip
        url = f"http://127.0.0.1:{http_port}"
        workers.append(
            ProcessSpec(
                name=worker,
                argv=argv,
                health_url=url + "/health",
                env={"KVTIER_WORKER_P2P_SECRET": secret, "KVTIER_WORKER_API_KEY": worker_key},
                role=role,
            )
        )
        backend: dict[str, Any] = {
            "name": worker,
            "url": url,
            "role": role,
            "dialect": options.dialect.value,
            "api_key": worker_key,
            "events_endpoint": events_endpoint,
            "events_replay_endpoint": replay_endpoint,
        }
        if dp > 1:
            backend["data_parallel_size"] = dp
        if options.models or options.lora:
            backend["models"] = [served_name or name, *adapters]
        backends.append(backend)
        events[worker] = events_endpoint
    router_options: dict[str, Any] = {
        "model_seed": f"{name}/seed=0",
        "block_size": BLOCK_SIZE,
        # Event sockets come from each backend's events_endpoint / events_replay_endpoint.
        "tokenizer": {"kind": "bytes"},
    }
    if options.redis_url:
        router_options["index_url"] = options.redis_url
    proxy_config: dict[str, Any] = {
        "host": options.host,
        "port": options.port,
        "backends": backends,
        "router": options.router,
        # Quick to admit (start-up), slow to eject: a busy laptop must not flap the workers.
        "health": {"interval_s": 1.0, "healthy_threshold": 1, "unhealthy_threshold": 3},
        "admin_key": admin_key,
    }
    if options.router == "kv":
        proxy_config["router_options"] = router_options
    if options.models or options.lora:
        served_models: dict[str, Any] = {m: {} for m in options.models}
        served_models.update({adapter: {"base": model} for adapter, model in options.lora})
        proxy_config["models"] = {"served": served_models}
    config_path = run_dir / "proxy.yaml"
    proxy = proxy_process(options, config_path, host)
    return StackPlan(
        options=options,
        workers=tuple(workers),
        proxy=proxy,
        proxy_config=proxy_config,
        config_path=config_path,
        endpoint=f"http://{host}:{options.port}",
        model_name=name,
        events=events,
        admin_key=admin_key,
        worker_key=worker_key,
        models=(*(options.models or (name,)), *(a for a, _ in options.lora)),
    )


def admin_key_path(plan: StackPlan) -> Path:
    """Where the admin key is kept for the operator (the ready banner names this file)."""
    return plan.config_path.with_name("admin_key")


def write_proxy_config(plan: StackPlan) -> None:
    """The proxy's config holds the admin and worker keys, and the admin key has a file of its
    own for ``curl``: both owner-only (0600)."""
    write_private_text(plan.config_path, yaml.safe_dump(plan.proxy_config, sort_keys=False))
    write_private_text(admin_key_path(plan), plan.admin_key + "\n")
