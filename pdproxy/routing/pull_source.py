"""What a route decision tells the request path about a symmetric pull.

The node that prefills (the first producer of a disaggregated pair, or the consumer alone)
is sent ``kv_transfer_params.remote_kv_source`` naming ``holder``'s P2P server: it asks the
holder which of the prompt's blocks it has, pulls them, and computes only the rest. The
address is the holder backend's configured ``kv_address`` (never anything a client sent).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PullSource:
    holder: str
    """Backend name of the node holding the prefix."""
    host: str
    port: int
    engine_id: str | None
    """The holder's P2P node id (its handshake must prove it); None: not pinned."""
    blocks: int
    """Blocks the router expects the pull to move."""
