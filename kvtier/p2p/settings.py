"""Settings of the P2P tier (``KVTIER_P2P_*`` environment variables when built from the env).

Construct :class:`P2PSettings` explicitly (``P2PSettings()`` reads the environment at that call,
never at import) and pass it to the server, client and tier.
"""

from __future__ import annotations

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class P2PSettings(BaseSettings):
    """Transport, wait and lease bounds. Every wait in the protocol is bounded by one of these."""

    model_config = SettingsConfigDict(env_prefix="KVTIER_P2P_", frozen=True)

    secret: SecretStr | None = None
    """Shared secret: peers prove it in the handshake and every later frame and payload is
    authenticated under a key derived from it. Without one, only loopback peers are accepted."""
    require_producer_id: bool = False
    """Consumer: refuse a fetch whose producer node id is unknown (the consumer leg carries no
    ``remote_engine_id``). Off by default until every proxy forwards the id."""
    host: str = "127.0.0.1"
    port: int = Field(default=0, ge=0, le=65535)
    """Listening port of the producer server (0: pick a free one)."""
    connect_timeout_s: float = Field(default=2.0, gt=0)
    handshake_timeout_s: float = Field(default=2.0, gt=0)
    """Client: connect and handshake within this. Server: an accepted connection that has not
    sent its first frame (``auth``, its only one before authenticating) within this is closed."""
    fetch_timeout_s: float = Field(default=10.0, gt=0)
    """Consumer's default deadline for one fetch when the caller gives none."""
    demand_wait_s: float = Field(default=5.0, gt=0)
    """Longest a producer holds demand for a key while its request still runs."""
    max_fetch_s: float = Field(default=60.0, gt=0)
    """Longest a producer spends serving one fetch, whatever deadline the consumer names."""
    unknown_request_wait_s: float = Field(default=0.5, ge=0)
    """Grace for demand naming a kv_request_id the producer has not registered (yet)."""
    lease_s: float = Field(default=30.0, gt=0)
    """Supply lives this long after the producer request finishes (or after registration)."""
    lease_check_interval_s: float = Field(default=0.5, gt=0)
    idle_session_s: float = Field(default=60.0, gt=0)
    """A connection with no frame for this long is closed (both ends)."""
    max_frame_bytes: int = Field(default=4 << 20, ge=1024)
    max_keys_per_fetch: int = Field(default=65_536, ge=1)
    max_sessions_per_peer: int = Field(default=8, ge=1)
    """Idle sessions a consumer keeps per producer."""
    max_connections: int = Field(default=256, ge=1)
    """Authenticated sessions a producer serves at once; more are refused at the end of their
    handshake (and counted)."""
    max_pending_handshakes: int = Field(default=128, ge=1)
    """Unauthenticated connections a producer holds at once; one more evicts the oldest pending
    connection of the source address that holds the most (:mod:`kvtier.p2p.admission`)."""
    max_pending_handshakes_per_peer: int = Field(default=32, ge=1)
    """Unauthenticated connections from one source address at once; one more is closed on
    accept."""
    handshake_rate_per_s: float = Field(default=20.0, gt=0)
    """Handshake attempts per second and source address (refill of its token bucket)."""
    handshake_burst: int = Field(default=64, ge=1)
    """Handshake attempts one source address may make at once (an authenticated handshake
    gives its token back)."""
    verify_thread: bool | None = None
    """Consumer: verify fetched pages on a worker thread, overlapping the next receive (True),
    or each page on the event loop as soon as it lands (False). None: a thread when this process
    may run on at least 4 CPUs (:mod:`kvtier.p2p.installs` has the measurements)."""
    socket_buffer_bytes: int = Field(default=4 << 20, ge=0)
    """SO_SNDBUF / SO_RCVBUF (0 leaves the kernel default)."""
    released_memory: int = Field(default=4096, ge=0)
    """How many released kv_request_ids are remembered so late demand fails at once."""
    max_keys_per_offer: int = Field(default=16_384, ge=1)
    """Holder: keys one ``offer`` may name (symmetric pull, :mod:`kvtier.p2p.offer`); a larger
    offer closes the session. A puller offers at most this many (the rest is recomputed)."""
    max_open_offers_per_session: int = Field(default=4, ge=1)
    """Holder: supplies opened by offers on one session and not yet done, released or expired;
    one more closes the session (they stay until done, release or lease). A puller has one open
    at a time."""
    max_open_offers: int = Field(default=64, ge=1)
    """Holder: supplies opened by offers and not yet done, released or expired, over all
    sessions; one more offer is answered ``num_held: 0`` (counted in the refused total)."""
    offer_lease_s: float = Field(default=10.0, gt=0)
    """Holder: a supply opened by an offer is released this long after it was opened, fetched
    or not (the puller fetches at once, then says ``done``)."""
