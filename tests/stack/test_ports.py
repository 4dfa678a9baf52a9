"""Ports for launched processes: outside the ephemeral range, never promised twice, taken ones
skipped."""

from __future__ import annotations

import socket

import pytest

from pdproxy.stack.ports import PortAllocator, free_port, free_ports, non_ephemeral_range


def _listening(port: int) -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def test_the_range_avoids_the_ephemeral_one_and_the_service_ports() -> None:
    assert non_ephemeral_range((32_768, 60_999)) == (10_000, 32_767)
    assert non_ephemeral_range((1_024, 20_000)) == (20_001, 65_535)
    with pytest.raises(OSError, match="no room"):
        non_ephemeral_range((1_024, 65_000))


def test_free_ports_lie_outside_this_machines_ephemeral_range() -> None:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low, high = (int(x) for x in f.read().split())
    for port in [free_port(), *free_ports(20)]:
        assert not low <= port <= high
        assert port >= 10_000


def test_no_port_is_promised_twice_before_the_range_is_walked() -> None:
    ports = free_ports(200)
    assert len(set(ports)) == 200


def test_a_taken_port_is_skipped() -> None:
    # Find two adjacent free ports, then hold the first: an allocator starting there skips it.
    probe = PortAllocator(20_000, 29_999, seed=7)
    base = probe.run(2)
    held = _listening(base)
    try:
        allocator = PortAllocator(base, base + 1, seed=0)
        # Whatever its random start, it walks both ports: only the free one comes back.
        assert [allocator.port() for _ in range(3)] == [base + 1] * 3
    finally:
        held.close()


def test_a_run_is_consecutive_and_free() -> None:
    allocator = PortAllocator(20_000, 29_999, seed=3)
    base = allocator.run(4)
    held = [_listening(base + i) for i in range(4)]  # all four bind: all were free
    for s in held:
        s.close()


def test_an_exhausted_range_is_an_error_not_a_taken_port() -> None:
    probe = PortAllocator(20_000, 29_999, seed=11)
    base = probe.run(2)
    held = [_listening(base), _listening(base + 1)]
    try:
        with pytest.raises(OSError, match="no 1 consecutive free ports"):
            PortAllocator(base, base + 1).port()
        with pytest.raises(ValueError):
            PortAllocator(base, base + 1).run(2)
    finally:
        for s in held:
            s.close()
