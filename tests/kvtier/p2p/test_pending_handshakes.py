"""Silent connections cannot take a producer's handshake slots from legitimate peers (issue 30, 3).

Before the fix, one global ``max_pending_handshakes`` (128) was filled by 4 source addresses x 32
silent connections, each re-opened as the 2 s handshake deadline closed it, and every new
connection was then closed on accept: legitimate handshakes went from 29/29 to 0/73 (every
transfer recomputed). Now a full pending set evicts the oldest connection of the source that
holds the most pending handshakes, so a peer from another address always gets its turn; a source
at its own cap is refused (it can only displace itself).

The attacker here holds its connections open (a long handshake deadline), and tops the pending
set up again before every legitimate attempt, as a reconnecting attacker would.
"""

from __future__ import annotations

import asyncio
import socket

from .blocking_peer import BlockingPeer
from .conftest import FINGERPRINT, make_pair, settings, wait_until

ATTACKERS = [f"127.0.0.{11 + i}" for i in range(4)]
LEGIT = "127.0.0.30"
ROUNDS = 12


def _silent(port: int, source: str) -> socket.socket:
    sock = socket.socket()
    try:
        sock.bind((source, 0))
        sock.settimeout(3)
        sock.connect(("127.0.0.1", port))
    except BaseException:
        sock.close()
        raise
    return sock


def _legitimate_handshake(port: int) -> bool:
    sock = socket.socket()
    try:
        sock.bind((LEGIT, 0))
        sock.settimeout(3)
        sock.connect(("127.0.0.1", port))
        BlockingPeer(sock, FINGERPRINT)
    except (AssertionError, OSError):
        return False  # closed on accept (or before welcome): no session for this peer
    finally:
        sock.close()
    return True


async def test_silent_sources_cannot_starve_legitimate_handshakes() -> None:
    # The defaults (128 pending, 32 per source); only the deadline is long, so the attacker's
    # connections stay pending without being re-opened.
    pair = await make_pair(settings(handshake_timeout_s=60.0))
    held: list[socket.socket] = []
    try:
        limit = pair.server.settings.max_pending_handshakes
        per_source = pair.server.settings.max_pending_handshakes_per_peer
        assert len(ATTACKERS) * per_source >= limit  # the attack fills the set

        def fill() -> None:
            for source in ATTACKERS:
                held.extend(_silent(pair.port, source) for _ in range(per_source))

        await asyncio.to_thread(fill)
        await wait_until(lambda: pair.server.stats().handshakes == limit, timeout=10)
        served = 0
        for _ in range(ROUNDS):
            # The attacker takes back whatever slot the last round freed, from whichever of its
            # addresses is still below its own cap.
            for source in ATTACKERS:
                if pair.server.stats().handshakes == limit:
                    break
                accepted = pair.server.stats().accepted_total
                held.append(await asyncio.to_thread(_silent, pair.port, source))
                await wait_until(lambda a=accepted: pair.server.stats().accepted_total > a)
            assert pair.server.stats().handshakes == limit
            served += await asyncio.to_thread(_legitimate_handshake, pair.port)
        stats = pair.server.stats()
        assert served == ROUNDS, f"legitimate handshakes {served}/{ROUNDS}; {stats}"
        assert stats.handshakes <= limit
        assert stats.evicted_total >= ROUNDS, stats
    finally:
        for sock in held:
            sock.close()
        await pair.client.close()
        await pair.server.stop()


async def test_an_evicted_connection_is_closed_by_the_server() -> None:
    pair = await make_pair(
        settings(
            handshake_timeout_s=60.0, max_pending_handshakes=2, max_pending_handshakes_per_peer=2
        )
    )
    held: list[socket.socket] = []
    try:
        held = await asyncio.to_thread(lambda: [_silent(pair.port, ATTACKERS[0]) for _ in range(2)])
        await wait_until(lambda: pair.server.stats().handshakes == 2)
        assert await asyncio.to_thread(_legitimate_handshake, pair.port)

        def oldest_closed() -> bool:
            held[0].settimeout(5)
            data = b""
            try:
                while chunk := held[0].recv(4096):  # its hello, then the end of the stream
                    data += chunk
            except ConnectionResetError:
                pass
            return len(data) > 0

        assert await asyncio.to_thread(oldest_closed)  # the oldest one went, the socket with it
        await wait_until(lambda: pair.server.stats().handshakes == 1)
        assert pair.server.stats().evicted_total == 1
    finally:
        for sock in held:
            sock.close()
        await pair.client.close()
        await pair.server.stop()
