"""The connector's settings: ``kv_connector_extra_config`` of vLLM's ``--kv-transfer-config``.

One object, parsed once per connector instance (scheduler side and worker side parse the same
dict, so they agree on the P2P address they advertise). The P2P secret never travels on the
command line: :meth:`KvtierConnectorSettings.p2p_settings` builds :class:`P2PSettings` at that
call, which reads ``KVTIER_P2P_*`` from the environment (``KVTIER_P2P_SECRET`` above all) and
lets the fields set here override the environment.
"""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvtier.p2p.settings import P2PSettings
from kvtier.vllm.errors import KvtierConnectorConfigError


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

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, object] | None) -> KvtierConnectorSettings:
        """Parse vLLM's ``kv_connector_extra_config``; raises KvtierConnectorConfigError."""
        try:
            return cls.model_validate(dict(extra or {}))
        except ValidationError as exc:
            raise KvtierConnectorConfigError(f"kv_connector_extra_config: {exc}") from exc

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
