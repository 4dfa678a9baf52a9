"""The one-way rule for kvtier's vLLM connector: nothing imports ``kvtier.vllm`` (or vLLM) but
vLLM itself, which loads ``kvtier.vllm.connector`` by its module path."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_no_module_outside_kvtier_vllm_imports_it() -> None:
    modules = sorted(
        ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for package in ("kvtier", "pdproxy")
        for path in (ROOT / package).rglob("*.py")
        if not path.is_relative_to(ROOT / "kvtier" / "vllm") and path.name != "__main__.py"
    )
    modules = [m.removesuffix(".__init__") for m in modules]
    assert "kvtier.offload.tiering" in modules and not any(
        m.startswith("kvtier.vllm") for m in modules
    )
    code = (
        "import sys, importlib\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "bad = [m for m in sys.modules if m.split('.')[0] == 'vllm'"
        " or m.startswith('kvtier.vllm')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=240)
