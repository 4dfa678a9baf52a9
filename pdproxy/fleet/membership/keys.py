"""The CURVE client keys admitted to register, re-read while the proxy runs, and the ZAP handler
that admits them.

The keys are the public certificates (``*.key``) in ``registration.curve_clients_dir``. The
listener calls :meth:`AdmittedKeys.reload` every ``keys_reload_s``: a changed directory (a file
added, removed or rewritten) is read again, so an operator revokes a key by deleting its file
and re-enables it by putting it back, without a restart. From the reload on, :func:`key_gate`
refuses new handshakes with a revoked key; connections already open stay open (libzmq cannot
close one peer of a socket), so the listener also refuses their messages by key.

A file that cannot be read admits nothing (logged by name, never its content); a directory that
disappears or holds no key admits nobody.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.asyncio
from zmq.auth.certs import load_certificate
from zmq.utils import z85

from kvtier.events.curve import ClientGate

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


def key_gate(context: zmq.asyncio.Context, keys: AdmittedKeys) -> ClientGate:
    """The ZAP handler (ZMQ RFC 27) of the listener's context: kvtier's
    :class:`~kvtier.events.curve.ClientGate`, asking ``keys.allowed`` at each handshake so a
    reload takes effect at once. Its user id is the client's z85 public key, which each
    received message carries as ``frame.get("User-Id")``. Without a handler bound libzmq would
    admit any client that knows the server key: the gate is started before the socket binds,
    stopped after."""
    return ClientGate(context, lambda raw: z85.encode(raw).decode() in keys.allowed)
