"""The collector's view of a long-running kvtier process's heap.

:func:`freeze_startup_heap` is called once by a process's entry point when its startup is done
(``kvtier.worker``'s main, the benchmarks' ends); never by library code, since it changes the
whole process. vLLM does the same after its engine starts, so a connector inside vLLM needs
nothing.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Take what startup made (torch, the model, the pools: ~180,000 objects with torch
    loaded) out of the collector's sight.

    Why: a full collection walks every tracked object; with torch loaded one took 58 ms on the
    project's machine: a pause of the event loop that serves HTTP and P2P, due every time the
    long-lived generations grow enough, and 9% of the CPU of a loopback transfer benchmark.
    Objects made later are collected as usual; frozen ones are never freed (startup objects
    live as long as the process anyway).
    """
    gc.collect()
    gc.freeze()
