"""The one-way import rule: the proxy must run without torch."""

from __future__ import annotations

import subprocess
import sys


def test_import_pdproxy_does_not_import_torch() -> None:
    code = (
        "import sys, pkgutil, importlib, pdproxy\n"
        "for m in pkgutil.walk_packages(pdproxy.__path__, 'pdproxy.'):\n"
        "    importlib.import_module(m.name)\n"
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith('torch.')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_proxy_side_kvtier_modules_do_not_import_torch() -> None:
    code = (
        "import sys, importlib\n"
        "for name in ('kvtier.keys', 'kvtier.events', 'kvtier.residency', 'kvtier.offload',\n"
        "             'kvtier.announce'):\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ModuleNotFoundError as e:\n"
        "        if e.name != name: raise\n"
        "assert 'torch' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
