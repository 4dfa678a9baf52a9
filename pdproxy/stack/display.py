"""What ``pdproxy up`` shows: the ready banner and a live status board."""

from __future__ import annotations

import json
import shlex
import time
from collections.abc import Sequence
from typing import TextIO

from pdproxy.stack.supervisor import ProcessStatus


def curl_line(endpoint: str, model: str, api_key: str | None = None) -> str:
    """A ready-made ``curl`` for a streamed chat completion through the proxy."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Say hello"}],
        "max_tokens": 16,
        "stream": True,
    }
    parts = ["curl", "-sN", f"{endpoint}/v1/chat/completions"]
    parts += ["-H", "Content-Type: application/json"]
    if api_key:
        parts += ["-H", f"Authorization: Bearer {api_key}"]
    parts += ["-d", json.dumps(body, separators=(",", ":"))]
    return " ".join(shlex.quote(p) for p in parts)


def ready_banner(
    endpoint: str,
    model: str,
    log_dir: str,
    statuses: Sequence[ProcessStatus],
    admin_key_file: str = "",
) -> str:
    """The ready message. It names the file holding the admin key, never the key: this text
    may end up in a log file others can read."""
    lines = [
        "",
        f"PD stack ready: {endpoint}  (OpenAI API, model {model!r})",
        "",
        "Try:",
        "  " + curl_line(endpoint, model),
        "",
        f"Processes (logs in {log_dir}):",
        *(f"  {s.name:<12} pid {s.pid:<8} {s.role}" for s in statuses),
        "",
        *(
            [
                f"Admin API: curl -s {endpoint}/admin/backends "
                f'-H "Authorization: Bearer $(cat {shlex.quote(admin_key_file)})"'
            ]
            if admin_key_file
            else []
        ),
        "Ctrl-C stops every process.",
        "",
    ]
    return "\n".join(lines)


def _row(status: ProcessStatus) -> str:
    if not status.running:
        state = "EXITED"
    elif status.healthy:
        state = "healthy"
    else:
        state = "UNHEALTHY"
    return f"  {status.name:<12} {status.role:<9} pid {status.pid:<8} {state:<10} {status.detail}"


class StatusBoard:
    """Prints the processes' status: redrawn in place on a terminal, on change otherwise."""

    def __init__(self, out: TextIO, redraw: bool) -> None:
        self._out = out
        self._redraw = redraw
        self._drawn_lines = 0
        self._last: list[tuple[str, bool, bool]] = []

    def show(self, statuses: Sequence[ProcessStatus]) -> None:
        rows = [_row(s) for s in statuses]
        stamp = f"status {time.strftime('%H:%M:%S')}"
        if self._redraw:
            up = f"\x1b[{self._drawn_lines}F\x1b[J" if self._drawn_lines else ""
            text = up + "\n".join([stamp, *rows]) + "\n"
            self._drawn_lines = len(rows) + 1
        else:
            # Health details (counters) change all the time; print when a state changes.
            states = [(s.name, s.running, s.healthy) for s in statuses]
            if states == self._last:
                return
            self._last = states
            text = "\n".join([stamp, *rows]) + "\n"
        try:
            self._out.write(text)
            self._out.flush()
        except OSError:  # the terminal went away; the supervisor is stopping anyway
            pass
