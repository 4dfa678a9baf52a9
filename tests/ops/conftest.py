"""Tools these tests drive: Debian's ``prometheus`` and ``promtool`` (``docker/engine setup``
installs them; ``scripts/dev test`` runs it). Missing: skip locally, fail under CI."""

from __future__ import annotations

import os
import shutil

import pytest


def need_tool(name: str) -> str:
    exe = shutil.which(name)
    if exe is not None:
        return exe
    reason = f"{name} is not installed (Debian: apt-get install prometheus; scripts/dev test does)"
    if os.environ.get("CI") or os.environ.get("PDPROXY_OPS_REQUIRED"):
        pytest.fail(reason)
    pytest.skip(reason)
