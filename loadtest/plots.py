"""PNG plots of benchmark and Locust results, written next to their JSON.

One result JSON per target (``bench_client --result-json``, Locust ``--report-json``; both
vLLM-bench style, with per-request ``ttfts``/``itls``/``start_times``/``e2els``):

- ``<stem>-latency.png``: TTFT and ITL distributions (empirical CDFs) per target;
- ``<stem>-throughput.png``: completed requests and output tokens per second over the run;
- ``<stem>-ratios.png`` (two targets or more): each target's p50/p99 TTFT and ITL and its
  throughput as a ratio of the baseline's (``--baseline``; the first file by default), as the
  benchmarks print them.

    python -m loadtest.plots router.json proxy.json --baseline router
    python -m loadtest.bench_client ... --result-json run.json --plot

Needs matplotlib (``pip install '.[plot]'``; the ``dev`` extra has it).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtest.serving_metrics import percentile


class PlotError(Exception):
    """A result file that cannot be plotted (not a result, or no per-request details)."""


@dataclass(frozen=True, slots=True)
class Run:
    """One target's result: raw per-request samples in milliseconds and seconds."""

    label: str
    ttfts_ms: tuple[float, ...]
    itls_ms: tuple[float, ...]
    finishes_s: tuple[float, ...]
    """Completion time of each successful request on the run's clock."""
    output_lens: tuple[int, ...]
    duration_s: float

    def quantile(self, metric: str, p: float) -> float:
        values = sorted(self.ttfts_ms if metric == "ttft" else self.itls_ms)
        return percentile(values, p)

    @property
    def throughput(self) -> float:
        return len(self.finishes_s) / self.duration_s if self.duration_s > 0 else 0.0


def load_run(path: Path, label: str | None = None) -> Run:
    try:
        doc: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise PlotError(f"{path}: not a readable JSON result ({exc})") from exc
    needed = ("ttfts", "itls", "errors", "output_lens")
    if any(key not in doc for key in needed):
        raise PlotError(f"{path}: no per-request details (run without --no-details)")
    ok = [not e for e in doc["errors"]]
    starts = doc.get("start_times") or [0.0] * len(ok)
    e2els = doc.get("e2els") or [0.0] * len(ok)
    return Run(
        label=label or path.stem,
        ttfts_ms=tuple(t * 1000 for t, good in zip(doc["ttfts"], ok, strict=True) if good and t),
        itls_ms=tuple(
            g * 1000 for gaps, good in zip(doc["itls"], ok, strict=True) if good for g in gaps
        ),
        finishes_s=tuple(s + e for s, e, good in zip(starts, e2els, ok, strict=True) if good),
        output_lens=tuple(n for n, good in zip(doc["output_lens"], ok, strict=True) if good),
        duration_s=float(doc.get("duration") or 0.0),
    )


def _figure(rows: int, cols: int, width: float = 11.0, height: float = 4.0) -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise PlotError("plots need matplotlib: pip install '.[plot]'") from exc
    return Figure(figsize=(width, height * rows), layout="constrained")


def _cdf(ax: Any, values: Sequence[float], label: str) -> None:
    xs = sorted(values)
    if not xs:
        return
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    ax.step(xs, ys, where="post", label=f"{label} (n={len(xs)})")


def latency_figure(runs: Sequence[Run]) -> Any:
    fig = _figure(1, 2)
    axes = fig.subplots(1, 2)
    for ax, metric, title in zip(axes, ("ttft", "itl"), ("TTFT", "ITL"), strict=True):
        for run in runs:
            _cdf(ax, run.ttfts_ms if metric == "ttft" else run.itls_ms, run.label)
        ax.set_title(f"{title} distribution")
        ax.set_xlabel(f"{title} (ms)")
        ax.set_ylabel("fraction of samples ≤ x")
        ax.set_xscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="lower right", fontsize="small")
    return fig


def throughput_figure(runs: Sequence[Run], bin_s: float | None = None) -> Any:
    fig = _figure(1, 2)
    axes = fig.subplots(1, 2)
    end = max((max(r.finishes_s, default=0.0) for r in runs), default=0.0)
    width = bin_s or max(end / 30, 0.5)
    bins = max(1, math.ceil(end / width))
    for run in runs:
        reqs = [0.0] * bins
        toks = [0.0] * bins
        for t, n in zip(run.finishes_s, run.output_lens, strict=True):
            i = min(int(t / width), bins - 1)
            reqs[i] += 1 / width
            toks[i] += n / width
        xs = [(i + 0.5) * width for i in range(bins)]
        axes[0].plot(xs, reqs, marker=".", label=run.label)
        axes[1].plot(xs, toks, marker=".", label=run.label)
    for ax, unit in zip(axes, ("requests/s", "output tokens/s"), strict=True):
        ax.set_title(f"Throughput over time ({unit}, {width:.1f} s bins)")
        ax.set_xlabel("time since start (s)")
        ax.set_ylabel(unit)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    return fig


RATIO_METRICS: tuple[tuple[str, Callable[[Run], float]], ...] = (
    ("p50 TTFT", lambda r: r.quantile("ttft", 50)),
    ("p99 TTFT", lambda r: r.quantile("ttft", 99)),
    ("p50 ITL", lambda r: r.quantile("itl", 50)),
    ("p99 ITL", lambda r: r.quantile("itl", 99)),
    ("throughput", lambda r: r.throughput),
)


def ratios(runs: Sequence[Run], baseline: Run) -> dict[str, dict[str, float]]:
    """``{target: {metric: target / baseline}}`` (NaN where the baseline measured 0)."""
    out: dict[str, dict[str, float]] = {}
    for run in runs:
        if run is baseline:
            continue
        row = {}
        for name, measure in RATIO_METRICS:
            base = measure(baseline)
            row[name] = measure(run) / base if base else math.nan
        out[run.label] = row
    return out


def ratio_figure(runs: Sequence[Run], baseline: Run) -> Any:
    table = ratios(runs, baseline)
    fig = _figure(1, 1, width=9.0)
    ax = fig.subplots()
    names = [name for name, _ in RATIO_METRICS]
    width = 0.8 / max(len(table), 1)
    for i, (label, row) in enumerate(table.items()):
        xs = [j + i * width for j in range(len(names))]
        values = [row[n] for n in names]
        bars = ax.bar(xs, [0.0 if math.isnan(v) else v for v in values], width, label=label)
        ax.bar_label(
            bars, labels=["n/a" if math.isnan(v) else f"{v:.2f}" for v in values],
            fontsize="small",
        )  # fmt: skip
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + width * (len(table) - 1) / 2 for j in range(len(names))], names)
    ax.set_ylabel(f"ratio to {baseline.label}")
    ax.set_title(
        f"Against the baseline {baseline.label!r}, same session "
        "(latency < 1: faster; throughput > 1: more)"
    )
    ax.legend(fontsize="small")
    return fig


def write_plots(runs: Sequence[Run], out_dir: Path, stem: str, baseline: str = "") -> list[Path]:
    """Writes the PNGs; returns their paths."""
    if not runs:
        raise PlotError("no results to plot")
    out_dir.mkdir(parents=True, exist_ok=True)
    figures = {"latency": latency_figure(runs), "throughput": throughput_figure(runs)}
    if len(runs) > 1:
        base = next((r for r in runs if r.label == baseline), None) if baseline else runs[0]
        if base is None:
            raise PlotError(f"--baseline {baseline!r} is none of {[r.label for r in runs]}")
        figures["ratios"] = ratio_figure(runs, base)
    paths = []
    for name, fig in figures.items():
        path = out_dir / f"{stem}-{name}.png"
        fig.savefig(path, dpi=110)
        paths.append(path)
    return paths


def plot_result(path: Path) -> list[Path]:
    """One result JSON → its PNGs beside it (used by bench_client --plot and Locust)."""
    return write_plots([load_run(path)], path.parent, path.stem)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.plots", description=__doc__)
    parser.add_argument("results", nargs="+", type=Path, help="result JSON files, one per target")
    parser.add_argument("--label", action="append", default=[], help="a label per file, in order")
    parser.add_argument("--baseline", default="", help="label of the baseline (default: first)")
    parser.add_argument("--out-dir", type=Path, default=None, help="default: the first file's")
    args = parser.parse_args(argv)
    labels = list(args.label) + [None] * (len(args.results) - len(args.label))
    try:
        runs = [load_run(p, label) for p, label in zip(args.results, labels, strict=False)]
        first = args.results[0]
        paths = write_plots(runs, args.out_dir or first.parent, first.stem, args.baseline)
    except PlotError as exc:
        parser.error(str(exc))
    for path in paths:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
