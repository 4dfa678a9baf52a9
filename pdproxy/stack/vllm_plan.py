"""``pdproxy up --engine vllm``: the stack plan with real vLLM producers and consumers.

Same shape as :func:`pdproxy.stack.plan.build_plan` (workers first, the proxy last, one config
file), with vLLM instances instead of reference workers: NIXL between producers and consumers,
the proxy in the NIXL dialect, and the KV router matched to vLLM (block size, the model
directory's tokenizer and chat template, events from every instance).

``connector=VllmConnector.KVTIER`` (``pdproxy up --engine vllm --connector kvtier``) loads
kvtier's connector in every instance instead, with a fresh P2P secret per run (in each
instance's environment), one P2P port per instance, and the proxy in the ``p2p`` dialect with
each producer's ``kv_address`` set to its P2P server.

``options.lora`` (``pdproxy up --engine vllm --lora NAME``): every instance loads a LoRA adapter
per name, made from a seed in the run directory (:mod:`pdproxy.stack.vllm_lora`); backends list
their models and the proxy routes each adapter with its own KV router (``models.served``).
"""

from __future__ import annotations

import re
import secrets
from pathlib import Path
from typing import Any

from pdproxy.stack.plan import PortSource, StackOptions, StackPlan, model_name, proxy_process
from pdproxy.stack.ports import free_port, free_port_run
from pdproxy.stack.vllm_engine import (
    SERVED_NAME,
    VllmConnector,
    VllmPaths,
    VllmRole,
    proxy_backend,
    router_options,
    vllm_instance,
)
from pdproxy.stack.vllm_lora import make_adapter

_ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
"""Also a directory name in the run directory."""


def proxy_config(
    backends: list[dict[str, Any]],
    paths: VllmPaths,
    *,
    host: str,
    port: int,
    router: str = "kv",
    admin_key: str = "",
    redis_url: str | None = None,
    adapters: tuple[str, ...] = (),
) -> dict[str, Any]:
    """The proxy's config for vLLM backends (also what the system tests run); ``adapters``:
    LoRA adapters of the served model, each a model of its own for routing."""
    config: dict[str, Any] = {
        "host": host,
        "port": port,
        "backends": backends,
        "router": router,
        # vLLM on a few shared cores answers health checks slowly while it computes.
        "health": {"interval_s": 1.0, "healthy_threshold": 1, "unhealthy_threshold": 5},
    }
    if admin_key:
        config["admin_key"] = admin_key
    if any(b.get("events_listen") for b in backends):
        config["workers"] = 1  # one process can listen where the engines' ranks publish
    if router == "kv":
        options = router_options(paths)
        if redis_url:
            options["index_url"] = redis_url
        config["router_options"] = options
    if adapters:
        served: dict[str, Any] = {SERVED_NAME: {}}
        served.update({adapter: {"base": SERVED_NAME} for adapter in adapters})
        config["models"] = {"served": served}
    return config


def lora_adapters(options: StackOptions) -> tuple[str, ...]:
    """The adapters of ``--lora NAME[@MODEL]`` for vLLM, which serves one model
    (:data:`SERVED_NAME`): a ``@MODEL`` naming another is an error (ValueError)."""
    names: list[str] = []
    for adapter, model in options.lora:
        if model not in (SERVED_NAME, model_name(options.model)):
            raise ValueError(f"LoRA adapter {adapter!r}: vLLM serves {SERVED_NAME}, not {model!r}")
        if adapter == SERVED_NAME or adapter in names or not _ADAPTER_NAME.match(adapter):
            raise ValueError(f"LoRA adapter name {adapter!r} is taken or not [A-Za-z0-9._-]+")
        names.append(adapter)
    return tuple(names)


def build_vllm_plan(
    options: StackOptions,
    paths: VllmPaths,
    run_dir: Path,
    ports: PortSource = free_port,
    *,
    connector: VllmConnector = VllmConnector.NIXL,
    p2p_ports: PortSource = free_port,
) -> StackPlan:
    if options.producers < 1 or options.consumers < 1:
        raise ValueError("a PD stack needs at least one producer and one consumer")
    problem = paths.problem()
    if problem is not None:
        raise ValueError(problem)
    if options.models:
        raise ValueError("--models needs the reference workers: vLLM here serves one model")
    adapters = lora_adapters(options)
    socket_dir = run_dir / "sockets"
    socket_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    lora_modules = {
        name: make_adapter(run_dir / "lora" / name, name, base_model=str(paths.model_dir))
        for name in adapters
    }
    roles = [(VllmRole.PRODUCER, i) for i in range(options.producers)]
    roles += [(VllmRole.CONSUMER, i) for i in range(options.consumers)]
    kvtier = connector is VllmConnector.KVTIER
    p2p_secret = secrets.token_hex(16) if kvtier else None
    picked: set[int] = set()

    def p2p_port() -> int:
        port = p2p_ports()
        while port in picked:  # a fixed-range pick is not bound until vLLM starts
            port = p2p_ports()
        picked.add(port)
        return port

    dp = options.data_parallel_size
    if dp > 1 and kvtier:
        raise ValueError("--data-parallel-size with --connector kvtier is not supported")

    def side_channel() -> int:
        # Bound only once the engine has started: from the fixed range, like P2P ports; rank r
        # listens on the port + r.
        return p2p_port() if dp == 1 else free_port_run(dp)

    instances = [
        vllm_instance(
            f"{role.value[0]}{i}",
            role,
            paths,
            http_port=ports(),
            side_channel_port=None if kvtier else side_channel(),
            socket_dir=socket_dir,
            extra_args=options.worker_args,
            connector=connector,
            p2p_port=p2p_port() if kvtier else None,
            p2p_secret=p2p_secret,
            lora_modules=lora_modules,
            data_parallel_size=dp,
            dp_event_ports=(free_port_run(dp), free_port_run(dp)) if dp > 1 else None,
        )
        for role, i in roles
    ]
    host = "127.0.0.1" if options.host in ("0.0.0.0", "") else options.host
    admin_key = secrets.token_hex(16)
    config = proxy_config(
        [proxy_backend(i) for i in instances],
        paths,
        host=options.host,
        port=options.port,
        router=options.router,
        admin_key=admin_key,
        redis_url=options.redis_url,
        adapters=adapters,
    )
    config_path = run_dir / "proxy.yaml"
    proxy = proxy_process(options, config_path, host)
    return StackPlan(
        options=options,
        workers=tuple(i.spec for i in instances),
        proxy=proxy,
        proxy_config=config,
        config_path=config_path,
        endpoint=f"http://{host}:{options.port}",
        model_name=SERVED_NAME,
        events={i.spec.name: i.events_endpoint for i in instances},
        admin_key=admin_key,
        models=(SERVED_NAME, *adapters),
    )
