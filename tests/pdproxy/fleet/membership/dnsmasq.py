"""A real dnsmasq on a loopback port whose records a test changes.

A and AAAA records live in a hosts file (re-read on SIGHUP); SRV records are dnsmasq
configuration, which it reads only at start, so :meth:`Dnsmasq.set_srv` restarts it on the same
port (the proxy sees a short outage meanwhile, which must change nothing). Started and stopped
by PID.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import dns.exception
import dns.resolver
import pytest


class Dnsmasq:
    def __init__(self, workdir: Path, port: int, domain: str = "test") -> None:
        self.workdir = workdir
        self.port = port
        self.domain = domain
        self.hosts_path = workdir / "hosts"
        self.conf_path = workdir / "dnsmasq.conf"
        self.log_path = workdir / "dnsmasq.log"
        self.hosts: dict[str, list[str]] = {}
        self.srv: dict[str, list[tuple[str, int]]] = {}
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def nameserver(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        exe = shutil.which("dnsmasq") or "/usr/sbin/dnsmasq"
        if not os.path.exists(exe):
            pytest.fail("dnsmasq is not installed; scripts/dev installs it (dnsmasq-base)")
        self._write_hosts()
        lines = [
            f"port={self.port}", "listen-address=127.0.0.1", "bind-interfaces",
            "no-resolv", "no-hosts", "no-negcache", "local-ttl=0",
            f"local=/{self.domain}/", f"addn-hosts={self.hosts_path}",
        ]  # fmt: skip
        for name, targets in self.srv.items():
            lines += [f"srv-host={name},{target},{port}" for target, port in targets]
        self.conf_path.write_text("\n".join(lines) + "\n")
        argv = [exe, f"--conf-file={self.conf_path}", "--keep-in-foreground", "--pid-file="]
        if os.geteuid() == 0:
            argv.append("--user=root")  # the hosts file sits in a 0700 test directory
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        self._wait_answering()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    def set_hosts(self, name: str, addresses: list[str]) -> None:
        """A/AAAA records of ``name`` (re-read at once via SIGHUP)."""
        self.hosts[name] = list(addresses)
        self._write_hosts()
        if self.proc is not None:
            self.proc.send_signal(signal.SIGHUP)
            self._wait_answering()

    def set_srv(self, name: str, targets: list[tuple[str, int]]) -> None:
        """SRV records of ``name``: a restart on the same port."""
        self.srv[name] = list(targets)
        if self.proc is not None:
            self.stop()
            self.start()

    def _write_hosts(self) -> None:
        lines = [f"{address} {name}" for name, addrs in self.hosts.items() for address in addrs]
        self.hosts_path.write_text("\n".join(lines) + "\n")

    def _wait_answering(self) -> None:
        """Until the server answers a query and has the current hosts file (bounded)."""
        resolver = dns.resolver.Resolver(configure=False)
        resolver.nameservers = ["127.0.0.1"]
        resolver.port = self.port
        resolver.cache = None
        deadline = time.monotonic() + 10
        probe = next(iter(self.hosts), f"probe.{self.domain}")
        want = sorted(a for a in self.hosts.get(probe, []) if ":" not in a)
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                pytest.fail(f"dnsmasq exited: {self.log_path.read_text()[-2000:]}")
            try:
                answer = resolver.resolve(probe, "A", lifetime=0.5, search=False)
                got = sorted(r.to_text() for r in answer)
            except dns.resolver.NXDOMAIN:
                got = []
            except dns.resolver.NoAnswer:
                got = []
            except dns.exception.DNSException:
                time.sleep(0.05)
                continue
            if got == want:
                return
            time.sleep(0.05)
        pytest.fail(f"dnsmasq did not answer on port {self.port}")
