"""The CURVE client keys admitted to register, re-read while the proxy runs, and the ZAP handler
that admits them.

The keys are the public certificates (``*.key``) in ``registration.curve_clients_dir``. The
listener calls :meth:`AdmittedKeys.reload` every ``keys_reload_s``: a changed directory (a file
added, removed or rewritten) is read again, so an operator revokes a key by deleting its file
and re-enables it by putting it back, without a restart. From the reload on, :class:`KeyGate`
refuses new handshakes with a revoked key; connections already open stay open (libzmq cannot
close one peer of a socket), so the listener also refuses their messages by key.

A file that cannot be read admits nothing (logged by name, never its content); a directory that
disappears or holds no key admits nobody.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.asyncio
from zmq.auth.certs import load_certificate
from zmq.utils import z85

from kvtier.events.curve import ZAP_ENDPOINT
from kvtier.tasks import cancel_and_wait

log = logging.getLogger(__name__)

_Signature = tuple[tuple[str, int, int, int], ...]


@dataclass(frozen=True, slots=True)
class KeyChange:
    """What a reload changed (z85 public keys, as a message's ``User-Id`` carries them)."""

    added: frozenset[str]
    revoked: frozenset[str]


class AdmittedKeys:
    """The admitted client public keys (z85 text). Event loop only (reads a directory
    listing per reload; the files only when it changed)."""

    def __init__(self, directory: Path) -> None:
        self._directory = directory
        self._signature = self._scan()
        self.allowed: frozenset[str] = self._load()

    def reload(self) -> KeyChange | None:
        """Re-read the directory if it changed; what changed (None: nothing)."""
        signature = self._scan()
        if signature == self._signature:
            return None
        self._signature = signature
        before, self.allowed = self.allowed, self._load()
        change = KeyChange(self.allowed - before, before - self.allowed)
        if change.added or change.revoked:
            log.info(
                "registration: client keys reloaded (%d added, %d revoked, %d admitted)",
                len(change.added), len(change.revoked), len(self.allowed),
            )  # fmt: skip
        return change

    def _scan(self) -> _Signature:
        try:
            entries = []
            for path in self._directory.glob("*.key"):
                st = path.stat()
                entries.append((path.name, st.st_mtime_ns, st.st_size, st.st_ino))
        except OSError:
            return ()
        return tuple(sorted(entries))

    def _load(self) -> frozenset[str]:
        keys = set()
        for path in sorted(self._directory.glob("*.key")):
            try:
                public, _ = load_certificate(path)
            except (OSError, ValueError):
                log.warning("registration: cannot read client certificate %s: not admitted", path)
                continue
            if len(public) != 40:
                log.warning("registration: %s is not a CURVE certificate: not admitted", path)
                continue
            keys.add(public.decode())
        if not keys:
            log.warning("registration: no client key admitted (%s)", self._directory)
        return frozenset(keys)


class KeyGate:
    """The ZAP handler (ZMQ RFC 27) of the listener's context: admits the CURVE clients whose
    key is in ``keys.allowed`` at the time of their handshake. Its user id is the client's z85
    public key, which each received message carries as ``frame.get("User-Id")``.

    Like :class:`kvtier.events.curve.ClientGate`, but the set is read per handshake, so a
    reload takes effect at once. Without a handler bound libzmq would admit any client that
    knows the server key: the gate is started before the socket binds, stopped after."""

    def __init__(self, context: zmq.asyncio.Context, keys: AdmittedKeys) -> None:
        self._ctx = context
        self._keys = keys
        self._sock: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self.refused = 0

    def start(self) -> None:
        sock = self._sock = self._ctx.socket(zmq.REP)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(ZAP_ENDPOINT)
        self._task = asyncio.get_running_loop().create_task(
            self._serve(sock), name="pdproxy-registration-zap"
        )

    async def stop(self) -> None:
        task, self._task = self._task, None
        try:
            await cancel_and_wait(task)
        finally:
            if self._sock is not None:
                self._sock.close(linger=0)
                self._sock = None

    async def _serve(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart()
            await sock.send_multipart(self.answer(frames))

    def answer(self, frames: list[bytes]) -> list[bytes]:
        """``version, request_id, domain, address, identity, mechanism, credentials...`` ->
        ``version, request_id, status, text, user_id, metadata``."""
        if len(frames) < 6 or frames[0] != b"1.0":
            self.refused += 1
            return [b"1.0", frames[1] if len(frames) > 1 else b"", b"400", b"bad request", b"", b""]
        request_id, mechanism, credentials = frames[1], frames[5], frames[6:]
        if mechanism == b"CURVE" and len(credentials) == 1 and len(credentials[0]) == 32:
            key = z85.encode(credentials[0])
            if key.decode() in self._keys.allowed:
                return [b"1.0", request_id, b"200", b"OK", key, b""]
        self.refused += 1
        return [b"1.0", request_id, b"400", b"client key not admitted", b"", b""]
