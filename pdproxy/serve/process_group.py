"""``pdproxy serve --workers N``: N proxy processes on one port, and their supervisor.

The supervisor (the process ``pdproxy serve`` started as) binds N listening sockets to the same
address with ``SO_REUSEPORT`` (the kernel spreads new connections over them by a hash of the
connection, so each process gets about 1/N of them), and N private Unix sockets through which
the processes reach each other (:mod:`pdproxy.serve.siblings`), then forks N children. Each child
is a full proxy (its own event loop, backends, health checks, router, admission) serving its own
listening socket. Binding before forking surfaces a busy port as one error in the supervisor.

Signals: SIGTERM/SIGINT to the supervisor are forwarded, once, to every child, which drains as a
single proxy does (readiness false for ``drain_delay_s``, then in-flight requests get
``drain_timeout_s``); the supervisor exits 0 when all children exited 0. Children run in their
own process group so a signal to the supervisor's group (a terminal's Ctrl-C, a process
manager's group kill) reaches each child once, through the supervisor; a child whose supervisor
dies gets SIGTERM from the kernel (``PR_SET_PDEATHSIG``). A child that exits on its own stops
the group (exit status 1): the process manager restarts the whole proxy, no half-size group
stays up.

Threat model: the sibling sockets live in a fresh 0700 directory of the supervisor's user, so
only that user (and root) can reach them; see :mod:`pdproxy.serve.siblings` for what they serve.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import math
import os
import shutil
import signal
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from pdproxy.serve.siblings import Siblings
from pdproxy.settings import ProxySettings

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def process_count(requested: int) -> int:
    """``requested`` processes, or one per usable core for 0."""
    if requested > 0:
        return requested
    return len(os.sched_getaffinity(0)) or 1


def per_process_settings(settings: ProxySettings, count: int) -> ProxySettings:
    """Admission limits split over ``count`` processes (rounded up): the kernel spreads
    connections evenly, so N processes together admit about what one process would."""
    if count == 1:
        return settings
    a = settings.admission
    admission = a.model_copy(
        update={
            "max_concurrent": math.ceil(a.max_concurrent / count),
            "queue_size": math.ceil(a.queue_size / count),
            "max_connections": math.ceil(a.max_connections / count),
            "max_waiting_connections": math.ceil(a.max_waiting_connections / count),
            "max_waiting_per_source": math.ceil(a.max_waiting_per_source / count),
        }
    )
    return settings.model_copy(update={"admission": admission})


def bind_listeners(host: str, port: int, count: int) -> list[socket.socket]:
    """``count`` listening TCP sockets on one address (``SO_REUSEPORT``); port 0 picks one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(family, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((host, port))
            port = sock.getsockname()[1]
            sock.listen(2048)
            sock.set_inheritable(True)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


Serve = Callable[[ProxySettings, list[socket.socket], Siblings], None]
"""Runs one proxy process on its sockets until it is told to stop."""


@dataclasses.dataclass
class ProcessGroup:
    settings: ProxySettings
    count: int
    serve: Serve
    children: dict[int, int] = dataclasses.field(default_factory=dict)
    """pid -> index."""
    stopping: bool = False

    def run(self) -> int:
        listeners = bind_listeners(self.settings.host, self.settings.port, self.count)
        directory = Path(tempfile.mkdtemp(prefix="pdproxy-siblings-"))  # mode 0700
        try:
            sibling_sockets = [_bind_unix(directory / f"{i}.sock") for i in range(self.count)]
            log.info(
                "%d proxy processes on %s:%d", self.count, self.settings.host,
                listeners[0].getsockname()[1],
            )  # fmt: skip
            child_settings = per_process_settings(self.settings, self.count)
            supervisor = os.getpid()
            for index in range(self.count):
                pid = os.fork()
                if pid == 0:  # pragma: no cover - runs in the child, which never returns
                    self._child(
                        index, child_settings, listeners, sibling_sockets, directory,
                        supervisor=supervisor,
                    )  # fmt: skip
                self.children[pid] = index
            for sock in (*listeners, *sibling_sockets):
                sock.close()  # the children hold them; a dead child's queue must not linger
            return self._supervise()
        finally:
            for sock in (*listeners,):
                sock.close()
            shutil.rmtree(directory, ignore_errors=True)

    def _child(
        self,
        index: int,
        settings: ProxySettings,
        listeners: list[socket.socket],
        sibling_sockets: list[socket.socket],
        directory: Path,
        *,
        supervisor: int,
    ) -> None:
        status = 1
        try:
            os.setpgid(0, 0)
            _die_with_parent()
            # The supervisor died before the death signal was set. Compared with its pid, not
            # with 1: in a container the supervisor itself is pid 1.
            if os.getppid() != supervisor:
                log.error("proxy process %d: the supervisor is gone; not starting", index)
                return
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, signal.SIG_DFL)
            own = [listeners[index], sibling_sockets[index]]
            for sock in (*listeners, *sibling_sockets):
                if sock not in own:
                    sock.close()
            siblings = Siblings(directory, index, self.count)
            self.serve(settings, own, siblings)
            status = 0
        except BaseException:
            log.exception("proxy process %d failed", index)
        finally:
            logging.shutdown()
            os._exit(status)

    def _forward(self, sig: int, _frame: FrameType | None) -> None:
        if self.stopping:
            return  # one signal per child: a second one would cut the drain short
        self.stopping = True
        for pid in self.children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def _supervise(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._forward)
        status = 0
        while self.children:
            try:
                pid, wait_status = os.wait()
            except ChildProcessError:
                break
            index = self.children.pop(pid, None)
            code = os.waitstatus_to_exitcode(wait_status)
            if code != 0:
                status = 1
            if not self.stopping:
                log.error("proxy process %s exited (%d): stopping the others", index, code)
                status = 1
                self._forward(signal.SIGTERM, None)
        return status


def _bind_unix(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.listen(64)
    return sock


def _die_with_parent() -> None:
    """SIGTERM this process when the supervisor dies (Linux); elsewhere a no-op."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
