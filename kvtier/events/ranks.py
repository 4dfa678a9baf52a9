"""Where a data-parallel rank publishes: vLLM's ``ZmqEventPublisher.offset_endpoint_port``.

Every DP rank of an engine runs its own publisher; rank ``r`` binds the configured endpoint's
port + ``r`` (``inproc://`` endpoints get a ``_dp<r>`` suffix), and so does its replay socket.
Subscribers find rank ``r``'s stream by the same rule. ``ipc://`` endpoints get the suffix
here (kvtier's reference worker), but vLLM 0.32 refuses them for rank 1 and up (its engine core
dies at start-up: "Invalid endpoint: must contain 'inproc' or 'tcp'"), so a DP vLLM publishes
on ``tcp://`` only.
"""

from __future__ import annotations


def offset_endpoint(endpoint: str | None, rank: int) -> str | None:
    """``tcp://h:p`` → ``tcp://h:p+rank``; a ``*`` port (any free port) stays ``*``.

    Raises ``ValueError`` for a rank below 0, an endpoint with no port to offset, or a port
    past 65535.
    """
    if rank < 0:
        raise ValueError(f"data-parallel rank {rank} is negative")
    if endpoint is None or rank == 0:
        return endpoint
    if endpoint.startswith(("ipc://", "inproc://")):
        return f"{endpoint}_dp{rank}"
    head, sep, port = endpoint.rpartition(":")
    if not endpoint.startswith("tcp://") or not sep or not (port.isdigit() or port == "*"):
        raise ValueError(f"cannot offset KV events endpoint {endpoint!r} by a rank")
    if port == "*":
        return endpoint
    if int(port) + rank > 65535:
        raise ValueError(f"KV events endpoint {endpoint!r} + rank {rank} is past port 65535")
    return f"{head}:{int(port) + rank}"
