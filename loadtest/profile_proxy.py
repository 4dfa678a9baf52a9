"""Where one proxied request spends its Python: calls per request and the modules it runs in.

Starts instant fake backends (:mod:`loadtest.fake_backend`) and ``pdproxy serve`` (one process,
NIXL dialect, round robin) in a child process that profiles itself with :mod:`cProfile` only
between two signals, so start-up and warm-up are not counted. After a warm-up, for each kind of
request (non-stream and 64-chunk stream, completions and chat), sends ``--requests`` requests one
after another under the profiler and prints:

- Python function calls per request (cProfile's count: calls into Python functions and into
  built-ins, the number the hot-path budget is kept in);
- the number of modules (files) that ran code, and how many of them are pdproxy's;
- with ``--top N``, the N functions with the most calls per request;
- with ``--callers N``, the N functions that make the most calls per request (the callers);
- with ``--by-module``, the calls made from each module family's code (the budget's lines).

A single streamed chat completion (``--requests 1 --kind chat-stream``) lists the pdproxy
modules it executed with ``--modules``. Counts, not timings: they do not depend on how busy
the machine is.

    python -m loadtest.profile_proxy [--requests 1000] [--kind chat-stream ...] [--top 30]
        [--callers 30] [--by-module] [--modules] [--proxy-tree DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import orjson

from loadtest.child import child_process
from pdproxy.stack.ports import free_port

KINDS = ("completions", "completions-stream", "chat", "chat-stream")
_JSON = {"content-type": "application/json"}
_PROMPT = "the quick brown fox " * 20


def _body(kind: str) -> tuple[str, bytes]:
    stream = kind.endswith("-stream")
    if kind.startswith("chat"):
        body: dict[str, object] = {
            "model": "fake-model",
            "messages": [{"role": "user", "content": _PROMPT}],
        }
        path = "/v1/chat/completions"
    else:
        body = {"model": "fake-model", "prompt": _PROMPT}
        path = "/v1/completions"
    body.update(max_tokens=64, stream=stream, top_p=0.9)
    return path, orjson.dumps(body)


# ------------------------------------------------------------------ the profiled proxy (child)

# Run with ``python -c`` so that it works against any tree (``--proxy-tree``), also one that
# predates this module. Each function is counted by its code object: pstats keys functions by
# (file, line, name), which merges, for instance, every dataclass's generated ``__init__``.
_CHILD = """
import cProfile, json, signal, sys
from pdproxy.cli import main

out, argv = sys.argv[1], sys.argv[2:]
profiler = cProfile.Profile()

def start(_sig, _frame):
    profiler.enable()

def stop(_sig, _frame):
    profiler.disable()
    def key(code):
        if isinstance(code, str):
            return ["~", 0, code]
        return [code.co_filename, code.co_firstlineno, code.co_qualname]

    rows = []
    for entry in profiler.getstats():
        callees = [key(sub.code) + [sub.callcount] for sub in (entry.calls or ())]
        rows.append(key(entry.code) + [entry.callcount, callees])
    with open(out + ".tmp", "w") as f:
        json.dump(rows, f)
    import os
    os.replace(out + ".tmp", out)
    profiler.clear()

signal.signal(signal.SIGUSR1, start)
signal.signal(signal.SIGUSR2, stop)
main(argv)
"""


# ------------------------------------------------------------------ the load (parent)


async def _ready(session: aiohttp.ClientSession, url: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with contextlib.suppress(aiohttp.ClientError):
            async with session.get(url) as resp:
                if resp.status == 200:
                    return
        await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} not ready in 60 s")


async def _send(session: aiohttp.ClientSession, url: str, kind: str, n: int) -> None:
    path, body = _body(kind)
    for _ in range(n):
        async with session.post(url + path, data=body, headers=_JSON) as resp:
            await resp.read()
            if resp.status != 200:
                raise RuntimeError(f"proxy answered {resp.status}")


Callee = tuple[str, int, str, int]
"""(file, first line, qualified name, calls); file ``~`` for built-ins."""
Row = tuple[str, int, str, int, list[Callee]]
"""A function as a callee (its calls) and as a caller (the calls it made, per callee)."""


def _profile_of(path: Path, deadline_s: float = 30.0) -> list[Row]:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if path.exists():  # written whole, then renamed
            data = orjson.loads(path.read_bytes())
            return [
                (str(f), int(line), str(name), int(n), [tuple(c) for c in callees])
                for f, line, name, n, callees in data
            ]
        time.sleep(0.05)
    raise RuntimeError("the proxy wrote no profile")


def _where(file: str, line: int) -> str:
    return "built-in" if file == "~" else f"{Path(file).name}:{line}"


def module_family(file: str) -> str:
    """Where code lives, for the budget: ``pdproxy/<folder or module>``, a library's top-level
    package, or ``python`` for the standard library."""
    parts = Path(file).parts
    if "pdproxy" in parts:
        i = len(parts) - 1 - parts[::-1].index("pdproxy")
        rest = parts[i + 1 :]
        return "pdproxy/" + (rest[0].removesuffix(".py") if rest else "")
    if "site-packages" in parts:
        return parts[parts.index("site-packages") + 1].removesuffix(".py")
    return "python"


def _report(
    rows: list[Row], kind: str, n: int, *, top: int, callers: int, by_module: bool,
    modules: bool, tree: Path,
) -> None:  # fmt: skip
    calls = sum(row[3] for row in rows)
    files = {row[0] for row in rows if row[0] != "~" and row[3]}
    ours = sorted(f for f in files if f"{os.sep}pdproxy{os.sep}" in f)
    print(
        f"{kind:20} {calls / n:8.0f} calls/request  {len(files):3d} modules  {len(ours):3d} pdproxy"
    )
    if modules:
        for f in ours:
            print("    " + f.removeprefix(str(tree) + os.sep))
    for file, line, name, count, _ in sorted(rows, key=lambda row: row[3], reverse=True)[:top]:
        print(f"    {count / n:7.1f}  {name}  ({_where(file, line)})")
    made = [(sum(c[3] for c in row[4]), row) for row in rows if row[0] != "~"]
    if callers:
        print(f"  top {callers} callers (calls each made, per request):")
        for count, (file, line, name, _, _) in sorted(made, key=lambda m: m[0], reverse=True)[
            :callers
        ]:
            print(f"    {count / n:7.1f}  {name}  ({_where(file, line)})")
    if by_module:
        # Calls made from each family's code; what nobody profiled called (the event loop's
        # callbacks, the server's protocol entry points) is the loop's.
        family: dict[str, int] = {}
        for count, row in made:
            key = module_family(row[0])
            family[key] = family.get(key, 0) + count
        called = {(c[0], c[1], c[2]): 0 for row in rows for c in row[4]}
        for row in rows:
            for c in row[4]:
                called[(c[0], c[1], c[2])] += c[3]
        family["(event loop)"] = sum(
            row[3] - called.get((row[0], row[1], row[2]), 0) for row in rows
        )
        print("  calls made from each module family, per request:")
        for key, count in sorted(family.items(), key=lambda kv: kv[1], reverse=True):
            if count / n >= 0.5:
                print(f"    {count / n:7.1f}  {key}")


async def _run(args: argparse.Namespace) -> None:
    p_port, d_port, x_port = free_port(), free_port(), free_port()
    p_url, d_url = f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"
    proxy = f"http://127.0.0.1:{x_port}"
    env = {**os.environ, "PDPROXY_HEALTH__ENABLED": "false", "PDPROXY_WORKERS": "1"}
    backends = [sys.executable, "-m", "loadtest.fake_backend", "--chunks", "64",
                "--listen", f"P={p_port}", "--listen", f"D={d_port}"]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        out = Path(tmp) / "profile"
        serve = ["serve", "--port", str(x_port), "--producer", p_url, "--consumer", d_url,
                 "--dialect", "nixl", "--log-level", "warning"]  # fmt: skip
        tree = Path(args.proxy_tree)
        argv = [sys.executable, "-c", _CHILD, str(out), *serve]
        stack.enter_context(child_process(backends))
        proxy_env = {**env, "PYTHONPATH": str(tree)}
        proc = stack.enter_context(child_process(argv, env=proxy_env, cwd=str(tree)))
        async with aiohttp.ClientSession() as session:
            for url in (p_url + "/health", d_url + "/health", proxy + "/ready"):
                await _ready(session, url)
            for kind in KINDS:  # every path and pool warm
                await _send(session, proxy, kind, 100)
            for kind in args.kind:
                out.unlink(missing_ok=True)
                os.kill(proc.pid, signal.SIGUSR1)
                await asyncio.sleep(0.1)
                await _send(session, proxy, kind, args.requests)
                os.kill(proc.pid, signal.SIGUSR2)
                _report(
                    _profile_of(out),
                    kind,
                    args.requests,
                    top=args.top,
                    callers=args.callers,
                    by_module=args.by_module,
                    modules=args.modules,
                    tree=tree,
                )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Python calls and modules per proxied request")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--kind", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--top", type=int, default=0, help="list the N most-called functions")
    parser.add_argument(
        "--callers", type=int, default=0, help="list the N functions making the most calls"
    )
    parser.add_argument(
        "--by-module", action="store_true", help="calls made from each module family's code"
    )
    parser.add_argument("--modules", action="store_true", help="list the pdproxy modules run")
    parser.add_argument(
        "--proxy-tree",
        default=str(Path(__file__).resolve().parent.parent),
        type=lambda s: str(Path(s).resolve()),
        help="the checkout whose proxy is profiled (e.g. the code before a change)",
    )
    args = parser.parse_args(argv)
    if not 1 <= args.requests <= 100_000:
        parser.error("--requests must be in 1..100000")
    asyncio.run(_run(args))


if __name__ == "__main__":
    main()
