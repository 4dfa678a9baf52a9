"""A sender of registration messages: vLLM's DEALER, with or without (good or bad) keys."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from kvtier.events.curve import load_client, make_client


class Registrant:
    """One DEALER connected to the registration endpoint. ``secret``: its CURVE secret
    certificate (None: a plain, unauthenticated socket)."""

    def __init__(
        self,
        endpoint: str,
        *,
        secret: Path | None,
        server_public: Path | None,
        identity: str = "10.0.0.1:21001",
    ) -> None:
        self._ctx = zmq.asyncio.Context()
        self.sock = self._ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, identity.encode())
        if secret is not None:
            assert server_public is not None
            make_client(self.sock, load_client(secret, server_public))
        self.sock.connect(endpoint)

    async def send(self, message: dict[str, Any] | bytes) -> bool:
        """Queue one message without blocking; False when libzmq would block (a socket whose
        handshake was refused has nowhere to send)."""
        payload = message if isinstance(message, bytes) else msgpack.dumps(message)
        try:
            await self.sock.send(payload, zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def close(self) -> None:
        self.sock.close(linger=0)
        self._ctx.term()


def vllm_message(kind: str, http_port: int, zmq_port: int = 21001, **extra: Any) -> dict[str, Any]:
    """What vLLM's ``P2pNcclEngine.ping`` sends (plus kvtier's optional keys in ``extra``)."""
    return {
        "type": kind,
        "http_address": f"127.0.0.1:{http_port}",
        "zmq_address": f"127.0.0.1:{zmq_port}",
        **extra,
    }
