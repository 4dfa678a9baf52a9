"""Reading callgrind dumps: instructions, calls into named functions, instructions per library."""

from __future__ import annotations

from pathlib import Path

from loadtest.bench_vs_router_fronts import ALLOCATORS, callgrind_by_object, callgrind_counts

# A dump in callgrind's compressed-name format: names are given once, where first used (by an
# ``ob=``/``cob=`` or ``fn=``/``cfn=`` line), then referred to by number; the cost line after
# ``calls=`` is the call's inclusive cost, not the caller's own.
_DUMP = """\
version: 1
creator: callgrind-3.19.0
events: Ir
ob=(1) /usr/lib/libpython3.11.so.1.0
fl=(1) ceval.c
fn=(1) _PyEval_EvalFrameDefault
10 500
cob=(2) /usr/lib/libc.so.6
cfi=(2) malloc.c
cfn=(2) malloc
calls=3 0
10 90
cfn=(3) PyObject_Malloc
calls=7 0
11 70
ob=(2)
fl=(2)
fn=(2)
0 90
ob=(1)
fn=(3)
0 70
fn=(1)
+2 40
cfn=(3)
calls=5 0
* 50

totals: 700
"""


def _dump(tmp_path: Path) -> Path:
    path = tmp_path / "callgrind.out.1"
    path.write_text(_DUMP)
    return path


def test_totals_and_calls_into_each_named_function(tmp_path: Path) -> None:
    total, calls = callgrind_counts(_dump(tmp_path), (*ALLOCATORS, "malloc"))
    assert total == 700
    assert calls["PyObject_Malloc"] == 12  # 7 + 5, the second call named by number only
    assert calls["malloc"] == 3
    assert calls["PyMem_Malloc"] == 0


def test_self_instructions_per_library_leave_out_inclusive_call_costs(tmp_path: Path) -> None:
    by_object = callgrind_by_object(_dump(tmp_path))
    assert by_object == {
        "/usr/lib/libpython3.11.so.1.0": 500 + 70 + 40,  # the eval loop's own and PyObject_Malloc's
        "/usr/lib/libc.so.6": 90,  # named first by a cob= line
    }
    assert sum(by_object.values()) == 700  # the totals line
