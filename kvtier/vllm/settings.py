"""The connector's settings: ``kv_connector_extra_config`` of vLLM's ``--kv-transfer-config``.

One object, parsed once per connector instance (scheduler side and worker side parse the same
dict, so they agree on the P2P address they advertise). The P2P secret never travels on the
command line: :meth:`KvtierConnectorSettings.p2p_settings` builds :class:`P2PSettings` at that
call, which reads ``KVTIER_P2P_*`` from the environment (``KVTIER_P2P_SECRET`` above all) and
lets the fields set here override the environment.
"""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvtier.p2p.settings import P2PSettings
from kvtier.vllm.errors import KvtierConnectorConfigError
from kvtier.worker.peers import PeerAllowlist


class KvtierConnectorSettings(BaseModel):
    """``kv_connector_extra_config`` keys (all optional but ``p2p_port`` on a producer)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    p2p_host: str = "127.0.0.1"
    """Address the worker's P2P server binds."""
    p2p_port: int = Field(default=0, ge=0, le=65535)
    """The P2P server's port. A producer (``kv_producer`` / ``kv_both``) needs a fixed one: the
    scheduler process answers producer legs with it, while the server lives in the worker."""
    advertise_host: str | None = None
    """Host consumers are told to fetch from (default: ``p2p_host``, or 127.0.0.1 when that is
    a wildcard)."""
    hash_seed: str | None = None
    """Names the model in kvtier's block hashes; producer and consumer must agree (the P2P
    handshake's layout fingerprint refuses a mismatch). Default: the served model name."""
    host_pages: int = Field(default=1024, ge=1)
    """Host pages (one per KV block, all layers) in the worker's primary tier."""
    fetch_timeout_s: float = Field(default=10.0, gt=0)
    """A consumer's fetch returns by this deadline, whatever the producer does; the rest of the
    prompt is then recomputed."""
    lease_s: float = Field(default=30.0, gt=0)
    """A producer keeps a supply this long after its leg ended unless the consumer says done."""
    offload_prompts: bool = False
    """Copy every request's full prompt blocks into host pages in the step that completes its
    prompt (only blocks the host pages lack; the pool's LRU bounds it), so this node can answer
    ``remote_kv_source`` offers for prompts it computed without a producer leg. Costs one copy
    per new block on the engine thread (``vllm:kvtier_offload_seconds_total``). Producer-only
    setting: it needs the P2P server."""
    kv_source_allowed_peers: list[str] = Field(default_factory=list)
    """Peers a leg may make this engine connect to (legs come from whoever can send requests to
    vLLM): a consumer leg's producer (``remote_prefiller``, or the NIXL-shaped answer's
    ``remote_host``) and a ``remote_kv_source`` holder; the reference worker's
    ``p2p_allowed_peers``. Entries as ``kvtier.worker.peers`` reads them (``host``,
    ``host:port``, ``10.0.0.0/8``, ``*`` for any); empty (the default): loopback only. A leg
    naming any other peer runs without it, computing its prompt (logged)."""
    offer_timeout_s: float = Field(default=2.0, gt=0)
    """A ``remote_kv_source`` leg waits this long for the holder's answer to its offer (the
    request stays queued meanwhile); past it, the request computes its prompt itself."""

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, object] | None) -> KvtierConnectorSettings:
        """Parse vLLM's ``kv_connector_extra_config``; raises KvtierConnectorConfigError."""
        try:
            return cls.model_validate(dict(extra or {}))
        except ValidationError as exc:
            raise KvtierConnectorConfigError(f"kv_connector_extra_config: {exc}") from exc

    @model_validator(mode="after")
    def _peers_parse(self) -> KvtierConnectorSettings:
        PeerAllowlist.parse(self.kv_source_allowed_peers)  # ValueError names a bad entry
        return self

    def allowed_peers(self) -> PeerAllowlist:
        return PeerAllowlist.parse(self.kv_source_allowed_peers)

    @property
    def advertised_host(self) -> str:
        if self.advertise_host:
            return self.advertise_host
        return "127.0.0.1" if self.p2p_host in ("0.0.0.0", "::", "") else self.p2p_host

    def p2p_settings(self) -> P2PSettings:
        """Transport settings: ``KVTIER_P2P_*`` from the environment, then these fields."""
        return P2PSettings(
            host=self.p2p_host,
            port=self.p2p_port,
            fetch_timeout_s=self.fetch_timeout_s,
            lease_s=self.lease_s,
        )
