"""The shape of the proxy package: one-way layers, no import circle, a short top level.

Every ``import`` counts, also those under ``TYPE_CHECKING`` and inside functions: a circle that
only type checking sees still means two modules that cannot be read apart.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pdproxy

ROOT = Path(pdproxy.__file__).resolve().parent

LAYERS: list[set[str]] = [
    {"errors", "origin", "settings"},
    {"observe", "upstream", "tokenize"},
    {"fleet"},
    {"front", "routing"},
    {"request"},
    {"admin", "app", "serve", "stack", "cli", "__main__"},
]
"""Bottom to top: a part may import its own layer's parts and those below, never above.
Mirrors the table in ``pdproxy/__init__.py``."""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports() -> dict[str, set[str]]:
    """Module -> the pdproxy modules it imports (a ``from pkg import name`` names
    ``pkg.name`` when that is a module, else ``pkg``)."""
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [
                    f"{node.module}.{a.name}"
                    if f"{node.module}.{a.name}" in modules
                    else node.module
                    for a in node.names
                ]
            else:
                continue
            edges.update(t for t in targets if t in modules and t != name)
        graph[name] = edges
    return graph


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _layer(part: str) -> int:
    for i, layer in enumerate(LAYERS):
        if part in layer:
            return i
    raise AssertionError(f"pdproxy.{part} is in no layer: add it to LAYERS")


def test_every_part_is_in_a_layer() -> None:
    for module in _imports():
        if module != "pdproxy":
            _layer(_part(module))


def test_no_part_imports_a_part_above_it() -> None:
    wrong = sorted(
        f"{a} -> {b}"
        for a, targets in _imports().items()
        if a != "pdproxy"
        for b in targets
        if b != "pdproxy" and _layer(_part(b)) > _layer(_part(a))
    )
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle() -> None:
    graph = _imports()
    # A package's __init__ re-exporting its modules is not a circle of its own.
    for name in graph:
        graph[name] = {t for t in graph[name] if not name.startswith(t + ".")}
    assert not _cycles(graph)


def test_cycle_finder_sees_a_circle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_top_level_is_short() -> None:
    modules = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(modules) <= 12, modules
    for folder in (p for p in ROOT.iterdir() if (p / "__init__.py").exists()):
        doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text()))
        assert doc and "Rule" in doc, f"pdproxy/{folder.name}/__init__.py states no rule"


def test_settings_import_no_runtime() -> None:
    """Rule 1 of ``pdproxy/settings``: loading the settings loads no part of the runtime."""
    code = (
        "import sys, pdproxy.settings\n"
        "ours = {'pdproxy', 'pdproxy.errors', 'pdproxy.origin', 'kvtier', 'kvtier.events',\n"
        "        'kvtier.events.ranks'}\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('pdproxy', 'kvtier', 'zmq',\n"
        "             'starlette', 'fastapi', 'prometheus_client', 'uvicorn', 'redis')\n"
        "             and m not in ours and not m.startswith('pdproxy.settings'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
