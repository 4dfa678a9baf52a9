"""freeze_startup_heap: startup objects leave the collector's sight, later ones do not.

Runs in a child interpreter: freezing is process-wide and would change this test process."""

from __future__ import annotations

import subprocess
import sys
import textwrap

_CHILD = textwrap.dedent(
    """
    import gc, weakref
    import torch  # what a worker's startup heap is mostly made of
    from kvtier.heap import freeze_startup_heap

    tracked = len(gc.get_objects())
    freeze_startup_heap()
    assert gc.get_freeze_count() >= tracked * 0.9, (gc.get_freeze_count(), tracked)
    assert len(gc.get_objects()) < tracked * 0.1, len(gc.get_objects())

    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other = b, a  # a cycle made after startup: only the collector frees it
    gone = weakref.ref(a)
    del a, b
    gc.collect()
    assert gone() is None
    print("ok", tracked, gc.get_freeze_count())
    """
)


def test_startup_heap_frozen_and_later_cycles_still_collected() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _CHILD], check=False, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ok ")
