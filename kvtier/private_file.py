"""Files that hold secrets (keys, configs with keys): readable by their owner only.

``write_private_text`` creates the file with mode 0600 from the start (no window in which it is
world-readable, whatever the umask) and narrows an existing file to 0600 before writing into it.
It refuses to follow a symlink at the path, so a planted link cannot redirect the secret.
Stdlib only: the proxy and the worker side both use it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

PRIVATE_MODE = 0o600


def write_private_text(path: Path, text: str) -> None:
    write_private_bytes(path, text.encode("utf-8"))


def write_private_bytes(path: Path, data: bytes) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(path, flags, PRIVATE_MODE)
    try:
        os.fchmod(fd, PRIVATE_MODE)  # an existing file keeps its old mode through O_CREAT
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def is_private(path: Path) -> bool:
    """Only the owner may read or write ``path`` (no group or other bits)."""
    return stat.S_IMODE(path.stat().st_mode) & 0o077 == 0
