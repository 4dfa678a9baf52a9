"""The local PD stack: a proxy plus producer and consumer reference workers as subprocesses.

``pdproxy up`` (registered by :func:`add_up_command`) or ``python -m pdproxy.stack``. The
package only starts processes (``python -m kvtier.worker``, ``python -m pdproxy.cli serve``);
it never imports torch or the worker.
"""

from __future__ import annotations

from pdproxy.stack.cli import add_up_command, main

__all__ = ["add_up_command", "main"]
