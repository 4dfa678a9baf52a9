"""Worker settings (pydantic-settings): CLI flags, ``KVTIER_WORKER_*`` env vars or a YAML file."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    AliasChoices,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvtier.worker.peers import PeerAllowlist

Role = Literal["producer", "consumer", "both"]

PLACEHOLDER_SECRETS = frozenset(
    {"change-me", "changeme", "change_me", "secret", "password", "placeholder", "xxx"}
)
"""Values that configuration templates ship (``change-me`` was compose's old default): a
worker refuses to start with one as its P2P secret or API key."""
ModelName = Literal["tiny", "sim"]


class WorkerSettings(BaseSettings):
    """Everything the worker needs; passed explicitly, never read from globals."""

    model_config = SettingsConfigDict(env_prefix="KVTIER_WORKER_", extra="forbid")

    role: Role = "both"
    model: ModelName = "tiny"
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    advertise_host: str | None = None
    """Host a consumer should connect to for P2P (defaults to ``host``)."""
    p2p_port: int = 0
    """P2P server port of a producer (0: any free port)."""
    p2p_secret: SecretStr = Field(
        default=SecretStr(""),
        validation_alias=AliasChoices(
            "p2p_secret", "KVTIER_WORKER_P2P_SECRET", "KVTIER_P2P_SECRET"
        ),
    )
    """Shared P2P secret; also read from ``KVTIER_P2P_SECRET``, the name DESIGN §5 and the
    P2P server's warning give (empty: only loopback peers)."""
    api_key: SecretStr | None = None
    """Bearer key (``KVTIER_WORKER_API_KEY``): when set, every route but ``/health`` and
    ``/metrics`` needs ``Authorization: Bearer <key>`` (see ``server/access.py``)."""
    max_body_bytes: int = Field(default=16 * 1024 * 1024 + 64 * 1024, ge=1024)
    """Largest request body (413 beyond): the proxy's default limit plus room for the
    ``kv_transfer_params`` it adds."""
    p2p_allowed_peers: list[str] = Field(default_factory=list)
    """Producers a consumer leg may be sent to: hosts, ``host:port``, IP networks (CIDR) or
    ``*`` (any: trusted fabrics only). Empty: loopback only. See ``kvtier/worker/peers.py``."""
    events_curve_secret_key_file: Path | None = None
    """ZMQ CURVE secret certificate of the event sockets (``python -m kvtier.events.curve``);
    with it, only subscribers whose public key is in ``events_curve_clients_dir`` connect."""
    events_curve_clients_dir: Path | None = None
    """Directory of the public certificates of the subscribers allowed to connect."""
    events_endpoint: str | None = None
    """ZMQ PUB endpoint for KV events, e.g. ``tcp://*:5557`` (None: no events)."""
    events_replay_endpoint: str | None = None
    """ZMQ ROUTER endpoint answering replay requests (None: no replay)."""
    announce_endpoint: str | None = None
    """The proxy's registration endpoint (``tcp://proxy:30001``): announce this worker there
    and heartbeat (``kvtier/worker/announce.py``). Needs both ``announce_curve_*`` files."""
    announce_curve_secret_key_file: Path | None = None
    """This worker's CURVE secret certificate for announcing (its public key must be in the
    proxy's ``membership.registration.curve_clients_dir``)."""
    announce_curve_server_key_file: Path | None = None
    """The proxy's public CURVE certificate."""
    announce_interval_s: float = Field(default=3.0, gt=0)
    """Heartbeat interval (vLLM's is 3 s; the proxy drains after its ``heartbeat_timeout_s``)."""
    announce_name: str | None = None
    """Backend name to announce (default: the proxy derives one from the HTTP address)."""
    engine_id: str = ""
    device: str = "auto"
    block_size: int = 16
    num_pages: int = 1024
    host_pages: int = 1024
    max_model_len: int = 4096
    max_running: int = 64
    max_batched_tokens: int = 2048
    default_max_tokens: int = 256
    """Chat requests without max_tokens generate at most this many (within the context)."""
    model_seed: int = 0
    lora_modules: list[str] = Field(default_factory=list)
    """LoRA adapters served from the start, ``name`` or ``name=path`` (vLLM's
    ``--lora-modules``); more are loaded with ``POST /v1/load_lora_adapter``."""
    max_loras: int = Field(default=8, ge=1)
    """Most LoRA adapters loaded at once."""
    # tiny
    tiny_hidden: int = 64
    tiny_layers: int = 4
    tiny_heads: int = 4
    tiny_kv_heads: int = 2
    tiny_ffn: int = 128
    sliding_window: int = 64
    dtype: Literal["float64", "float32"] = "float64"
    # sim latency model
    sim_prefill_ms_per_token: float = 0.0
    sim_decode_ms_per_step: float = 0.0
    # KV transfer
    fetch_timeout_s: float = 10.0
    supply_lease_s: float = 60.0
    torch_threads: int = Field(default=0, description="0: leave torch's default")
    shutdown_timeout_s: float = Field(default=5.0, ge=0)
    """On SIGTERM/SIGINT, requests in flight get this long to finish before they are aborted."""
    data_parallel_size: int = Field(default=1, ge=1, le=64)
    """Engines (data-parallel ranks) behind this one HTTP endpoint, each with its own KV cache
    and page pools; rank ``r`` serves P2P on ``p2p_port`` + ``r`` and publishes KV events on
    the events (and replay) endpoint's port + ``r``, tagged with its rank (vLLM's layout; see
    :mod:`kvtier.worker.ranks`)."""
    p2p_holder: bool = True
    """Answer P2P offers (symmetric pull: another node's ``remote_kv_source`` names this one)
    from this node's host pages and device blocks, whatever its role: a consumer-only worker
    then also listens on ``p2p_port`` (``--no-p2p-holder``: it does not)."""

    @field_validator("p2p_secret", "api_key")
    @classmethod
    def _no_placeholder(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and value.get_secret_value().strip().lower() in PLACEHOLDER_SECRETS:
            raise ValueError("a placeholder is not a secret; set a long random value")
        return value

    @field_validator("p2p_allowed_peers")
    @classmethod
    def _peers_parse(cls, value: list[str]) -> list[str]:
        PeerAllowlist.parse(value)  # a bad entry fails at start, not on the first consumer leg
        return value

    @model_validator(mode="after")
    def _curve_files_together(self) -> WorkerSettings:
        if (self.events_curve_secret_key_file is None) != (self.events_curve_clients_dir is None):
            raise ValueError(
                "events_curve_secret_key_file and events_curve_clients_dir go together"
            )
        return self

    @model_validator(mode="after")
    def _announce_needs_keys(self) -> WorkerSettings:
        if self.announce_endpoint is not None and (
            self.announce_curve_secret_key_file is None
            or self.announce_curve_server_key_file is None
        ):
            raise ValueError(
                "announce_endpoint needs announce_curve_secret_key_file and "
                "announce_curve_server_key_file"
            )
        return self

    @property
    def model_name(self) -> str:
        return self.served_model_name or f"kvtier-{self.model}"

    @property
    def hash_seed(self) -> str:
        """The block-hash seed: names the model so different models never share blocks."""
        return f"{self.model_name}/seed={self.model_seed}"

    @classmethod
    def from_file(cls, path: Path, **overrides: Any) -> WorkerSettings:
        """Settings from a YAML mapping, with explicit overrides (e.g. CLI flags) on top."""
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as exc:
            # PyYAML's text quotes the offending line, which may hold a key: position only.
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            raise ValueError(f"{path}: not valid YAML{where}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping of settings")
        data.update(overrides)
        return cls(**data)


def settings_error_text(exc: ValidationError) -> str:
    """A settings error without the offending values: a value in the wrong field or of the
    wrong type may be a secret (pydantic's own text quotes every input)."""
    lines = []
    for error in exc.errors(include_url=False, include_input=False, include_context=False):
        where = ".".join(str(part) for part in error["loc"]) or "settings"
        lines.append(f"{where}: {error['msg']}")
    return "; ".join(lines)
