"""ZMQ CURVE for the KV event sockets: encryption plus client authentication (libsodium, which
pyzmq bundles; :func:`require_curve` checks).

Why: every ``BlockStored`` carries the block's prompt token ids, so a plain SUB on a worker's
event socket (or a DEALER on its replay socket) reads users' prompts. With CURVE configured:

- the publisher (worker) holds a *server* secret certificate; its PUB and replay ROUTER sockets
  are CURVE servers, and a ZAP handler admits only the client public keys it was given;
- each subscriber (proxy) holds its own *client* secret certificate and the worker's public
  certificate; a subscriber without keys, with an unknown key pair, or expecting another server
  key completes no handshake and receives nothing, live or replayed.

Keys live in ZMQ certificate files (the ``zmq.auth`` format): ``NAME.key`` holds the public
key, ``NAME.key_secret`` both keys. ``python -m kvtier.events.curve DIR NAME`` writes a pair,
the secret one 0600. Key material is never logged or put in an error message; errors name the
file only.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import stat
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
from zmq.auth.certs import load_certificate
from zmq.utils import z85

from kvtier.errors import EventSecurityError
from kvtier.private_file import write_private_text
from kvtier.tasks import cancel_and_wait

logger = logging.getLogger(__name__)

PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"


@dataclass(frozen=True, slots=True)
class CurveServer:
    """A publisher's CURVE identity and the subscribers it admits (z85 public keys)."""

    public_key: bytes
    secret_key: bytes = field(repr=False)
    allowed_clients: frozenset[bytes]


@dataclass(frozen=True, slots=True)
class CurveClient:
    """A subscriber's CURVE identity and the publisher's public key it expects."""

    server_public_key: bytes
    public_key: bytes
    secret_key: bytes = field(repr=False)


def require_curve() -> None:
    if not zmq.has("curve"):
        raise EventSecurityError("this libzmq has no CURVE support (pyzmq's wheels do)")


def load_server(secret_file: Path, clients_dir: Path) -> CurveServer:
    """The publisher side: its secret certificate and the directory of admitted clients'
    public certificates (``*.key``)."""
    require_curve()
    public, secret = _load_secret(secret_file)
    if not clients_dir.is_dir():
        raise EventSecurityError(f"CURVE clients directory {clients_dir} does not exist")
    allowed = frozenset(_load_public(path) for path in sorted(clients_dir.glob("*.key")))
    if not allowed:
        raise EventSecurityError(f"no client public certificate (*.key) in {clients_dir}")
    return CurveServer(public, secret, allowed)


def load_client(secret_file: Path, server_public_file: Path) -> CurveClient:
    """The subscriber side: its own secret certificate and the publisher's public one."""
    require_curve()
    public, secret = _load_secret(secret_file)
    return CurveClient(_load_public(server_public_file), public, secret)


def make_server(sock: zmq.asyncio.Socket, keys: CurveServer) -> None:
    """Before ``bind``: ``sock`` accepts CURVE clients only."""
    sock.curve_secretkey = keys.secret_key
    sock.curve_publickey = keys.public_key
    sock.curve_server = True


def make_client(sock: zmq.Socket[Any], keys: CurveClient) -> None:
    """Before ``connect``: ``sock`` talks only to the server holding ``keys.server_public_key``."""
    sock.curve_serverkey = keys.server_public_key
    sock.curve_publickey = keys.public_key
    sock.curve_secretkey = keys.secret_key


ZAP_ENDPOINT = "inproc://zeromq.zap.01"
"""Where libzmq asks a context's ZAP handler about each handshake (ZMQ RFC 27)."""


@dataclass(frozen=True, slots=True)
class ZapRequest:
    """One handshake libzmq asks a ZAP handler about (ZMQ RFC 27)."""

    domain: bytes
    address: str
    """The peer's source IP address, as libzmq reports it."""
    mechanism: bytes
    """``NULL``, ``PLAIN`` or ``CURVE``."""
    credentials: tuple[bytes, ...]


class ZapHandler:
    """The ZAP handler of one context: asks ``decide`` about every handshake of its sockets.

    ``decide`` runs on the event loop, once per handshake, and must not block: it returns the
    user id to admit the peer under (each message it sends carries it as
    ``frame.get("User-Id")``), or None to refuse it. Without a handler bound, libzmq admits any
    CURVE client that knows the server's public key, and NULL peers of a socket with a ZAP
    domain are refused. (pyzmq's ``AsyncioAuthenticator`` polls a blocking socket and was seen
    to miss requests on a second context in one event loop; this reads an asyncio socket.)"""

    def __init__(
        self, context: zmq.asyncio.Context, decide: Callable[[ZapRequest], bytes | None]
    ) -> None:
        self._ctx = context
        self._decide = decide
        self._sock: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self.refused = 0

    def start(self) -> None:
        sock = self._sock = self._ctx.socket(zmq.REP)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(ZAP_ENDPOINT)
        self._task = asyncio.create_task(self._serve(sock), name="kv-events-zap")

    async def stop(self) -> None:
        task, self._task = self._task, None
        try:
            await cancel_and_wait(task)
        finally:
            self._close_socket()

    def _close_socket(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    async def _serve(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart()
            await sock.send_multipart(self._answer(frames))

    def _answer(self, frames: list[bytes]) -> list[bytes]:
        """``version, request_id, domain, address, identity, mechanism, credentials...`` →
        ``version, request_id, status, text, user_id, metadata``."""
        if len(frames) < 6 or frames[0] != b"1.0":
            self.refused += 1
            return [b"1.0", frames[1] if len(frames) > 1 else b"", b"400", b"bad request", b"", b""]
        request = ZapRequest(
            domain=frames[2],
            address=frames[3].decode(errors="replace"),
            mechanism=frames[5],
            credentials=tuple(frames[6:]),
        )
        user_id = self._decide(request)
        if user_id is not None:
            return [b"1.0", frames[1], b"200", b"OK", user_id, b""]
        self.refused += 1
        logger.debug("ZAP: refused a %s peer", request.mechanism.decode(errors="replace"))
        return [b"1.0", frames[1], b"400", b"not admitted", b"", b""]


class ClientGate(ZapHandler):
    """The ZAP handler that admits the CURVE clients of ``keys`` and refuses the rest."""

    def __init__(
        self, context: zmq.asyncio.Context, keys: CurveServer | Callable[[bytes], bool]
    ) -> None:
        """``keys``: the server's keys (a fixed set of admitted clients), or a predicate over a
        client's raw 32-byte public key, asked at each handshake (a set that can change)."""
        if isinstance(keys, CurveServer):
            allowed = frozenset(z85.decode(key) for key in keys.allowed_clients)
            self._admits: Callable[[bytes], bool] = allowed.__contains__
        else:
            self._admits = keys
        super().__init__(context, self._curve_client)

    def _curve_client(self, request: ZapRequest) -> bytes | None:
        credentials = request.credentials
        if (
            request.mechanism == b"CURVE"
            and len(credentials) == 1
            and len(credentials[0]) == 32
            and self._admits(credentials[0])
        ):
            # The user id is the client's z85 public key: a receiving socket reads it from each
            # message (``frame.get("User-Id")``) to tell which admitted client sent it.
            return z85.encode(credentials[0])
        return None


def _load_secret(path: Path) -> tuple[bytes, bytes]:
    public, secret = _read(path)
    if secret is None:
        raise EventSecurityError(f"{path} holds no secret key (give the *.key_secret file)")
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        logger.warning("CURVE secret certificate %s is readable by others (mode %o)", path, mode)
    return public, secret


def _load_public(path: Path) -> bytes:
    public, _ = _read(path)
    return public


def _read(path: Path) -> tuple[bytes, bytes | None]:
    try:
        public, secret = load_certificate(path)
    except (OSError, ValueError) as exc:
        raise EventSecurityError(f"cannot read CURVE certificate {path}") from exc
    if len(public) != 40 or (secret is not None and len(secret) != 40):
        raise EventSecurityError(f"{path} is not a CURVE certificate (z85 keys of 40 chars)")
    return public, secret


def write_certificate(directory: Path, name: str) -> tuple[Path, Path]:
    """A fresh key pair as ``NAME.key`` (public, 0644) and ``NAME.key_secret`` (0600)."""
    require_curve()
    public, secret = zmq.curve_keypair()
    directory.mkdir(parents=True, exist_ok=True)
    public_path = directory / f"{name}{PUBLIC_SUFFIX}"
    secret_path = directory / f"{name}{SECRET_SUFFIX}"
    body = f'metadata\ncurve\n    public-key = "{public.decode()}"\n'
    public_path.write_text(f"#   ZeroMQ CURVE Public Certificate (kvtier)\n\n{body}")
    write_private_text(
        secret_path,
        "#   ZeroMQ CURVE **Secret** Certificate (kvtier): keep it 0600\n\n"
        f'{body}    secret-key = "{secret.decode()}"\n',
    )
    return public_path, secret_path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvtier.events.curve",
        description="Write a CURVE key pair for the KV event sockets: DIR/NAME.key (public, "
        "hand it to the other side) and DIR/NAME.key_secret (0600, keep it).",
    )
    parser.add_argument("directory", type=Path)
    parser.add_argument("name")
    args = parser.parse_args(argv)
    public_path, secret_path = write_certificate(args.directory, args.name)
    sys.stdout.write(f"public: {public_path}\nsecret: {secret_path}\n")  # never the keys
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
