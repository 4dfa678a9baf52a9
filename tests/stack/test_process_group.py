"""A process group whose leader exited counts as stopped once only zombies remain (vLLM's engine
processes linger as zombies until init reaps them), and as running while any member runs."""

from __future__ import annotations

from pathlib import Path

from pdproxy.stack.process import _runs_in_group


def _proc_entry(root: Path, pid: int, comm: str, state: str, pgrp: int) -> Path:
    entry = root / str(pid)
    entry.mkdir()
    # /proc/PID/stat: pid (comm) state ppid pgrp ...; comm may hold spaces and parentheses.
    (entry / "stat").write_text(f"{pid} ({comm}) {state} 1 {pgrp} {pgrp} 0 -1 4194560 0\n")
    return entry


def test_zombies_do_not_keep_a_group_alive(tmp_path: Path) -> None:
    assert not _runs_in_group(_proc_entry(tmp_path, 11, "VLLM::Worker", "Z", 10), 10)
    assert _runs_in_group(_proc_entry(tmp_path, 12, "python (x) y", "S", 10), 10)
    assert not _runs_in_group(_proc_entry(tmp_path, 13, "python", "R", 99), 10)
    assert not _runs_in_group(tmp_path / "self", 10)  # not a pid
    assert not _runs_in_group(tmp_path / "404", 10)  # vanished meanwhile
