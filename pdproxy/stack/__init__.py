"""The local PD stack: a proxy plus producer and consumer reference workers as subprocesses.

Rule 1: only starts processes; never imports the worker, torch or vLLM.
Rule 2: every process it starts it stops, by PID, on every path out.

``pdproxy up`` (registered by :func:`add_up_command`) or ``python -m pdproxy.stack`` starts
``python -m kvtier.worker`` (or vLLM) and ``python -m pdproxy.cli serve``.
"""

from __future__ import annotations

from pdproxy.stack.cli import add_up_command, main

__all__ = ["add_up_command", "main"]
