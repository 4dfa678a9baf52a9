"""``python -m loadtest.reliability [--long]``: run the reliability suite, print its table.

Runs ``pytest tests/reliability`` in a subprocess (workers, proxies and redis-servers are real
processes the tests start and stop themselves). Every scenario appends one JSON line with its
counts to a results file; this command prints them as a table:

    scenario | outcome | sent | succeeded | failed | recovered-by-fallback | leaked resources

``--long`` runs the long variants as well (a 5-minute soak, more fuzz examples). Extra
arguments after ``--`` go to pytest (e.g. ``-- -k soak``). The exit status is pytest's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS_ENV = "KVTIER_RELIABILITY_RESULTS"
LONG_ENV = "KVTIER_RELIABILITY_LONG"
_COLUMNS = ("scenario", "outcome", "sent", "ok", "failed", "fallback", "leaked resources")


def run_suite(long: bool, pytest_args: list[str], results: Path) -> int:
    env = {**os.environ, RESULTS_ENV: str(results), LONG_ENV: "1" if long else "0"}
    cmd = [sys.executable, "-m", "pytest", "tests/reliability", "-q", "-p", "no:cacheprovider"]
    return subprocess.call([*cmd, *pytest_args], env=env)


def load_rows(results: Path) -> list[dict[str, Any]]:
    if not results.exists():
        return []
    rows = []
    for line in results.read_text(encoding="utf-8").splitlines():
        if line.strip():
            rows.append(json.loads(line))
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    cells = [
        (
            str(r["scenario"]),
            str(r["outcome"]),
            str(r["sent"]),
            str(r["succeeded"]),
            str(r["failed"]),
            str(r["fallback"]),
            "; ".join(r["leaks"]) or "none",
        )
        for r in rows
    ]
    totals = (
        "TOTAL",
        f"{sum(r['outcome'] == 'passed' for r in rows)}/{len(rows)} passed"
        + (
            f", {xfailed} xfail"
            if (xfailed := sum(r["outcome"] == "xfailed" for r in rows))
            else ""
        ),
        str(sum(r["sent"] for r in rows)),
        str(sum(r["succeeded"] for r in rows)),
        str(sum(r["failed"] for r in rows)),
        str(sum(r["fallback"] for r in rows)),
        str(sum(bool(r["leaks"]) for r in rows)) + " scenarios leaked",
    )
    widths = [max(len(c[i]) for c in [_COLUMNS, *cells, totals]) for i in range(len(_COLUMNS))]

    def line(values: tuple[str, ...]) -> str:
        return "| " + " | ".join(v.ljust(w) for v, w in zip(values, widths, strict=True)) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(_COLUMNS), sep, *map(line, cells), sep, line(totals)])


def format_notes(rows: list[dict[str, Any]]) -> str:
    out = [f"- {r['scenario']}: {'; '.join(r['notes'])}" for r in rows if r["notes"]]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.reliability", description=__doc__)
    parser.add_argument("--long", action="store_true", help="run the long variants too")
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvtier-reliability-") as tmp:
        results = Path(tmp) / "results.jsonl"
        started = time.monotonic()
        status = run_suite(args.long, args.pytest_args, results)
        elapsed = time.monotonic() - started
        rows = load_rows(results)
    print()
    verdict = "all passed" if status == 0 else f"pytest exit status {status}: see its output above"
    print(f"Reliability suite ({'long' if args.long else 'default'}): {elapsed:.0f} s, {verdict}")
    print(format_table(rows))
    notes = format_notes(rows)
    if notes:
        print("\nNotes:")
        print(notes)
    return status


if __name__ == "__main__":
    sys.exit(main())
