"""What each scenario reports to ``python -m loadtest.reliability``: one JSON line per test.

The report command sets ``KVTIER_RELIABILITY_RESULTS`` to a file; each test's :class:`Tally`
is appended there (with the test's outcome) when the test ends. Without the variable nothing is
written and the tallies only feed the tests' own assertions.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

RESULTS_ENV = "KVTIER_RELIABILITY_RESULTS"
LONG_ENV = "KVTIER_RELIABILITY_LONG"


@dataclass
class Tally:
    """Counts of one scenario: every client request ends in exactly one of the outcomes."""

    scenario: str
    sent: int = 0
    succeeded: int = 0
    failed: int = 0
    fallback: int = 0
    """Succeeded only thanks to a fallback (recompute, consumer-only, retry elsewhere)."""
    leaks: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def ok(self, *, fallback: bool = False) -> None:
        self.sent += 1
        self.succeeded += 1
        if fallback:
            self.fallback += 1

    def fail(self, note: str = "") -> None:
        self.sent += 1
        self.failed += 1
        if note and len(self.notes) < 5:
            self.notes.append(note)

    def write(self, outcome: str) -> None:
        path = os.environ.get(RESULTS_ENV)
        if not path:
            return
        line = json.dumps({**asdict(self), "outcome": outcome})
        with Path(path).open("a", encoding="utf-8") as f:
            f.write(line + "\n")


def long_mode() -> bool:
    """True when the suite runs its long variants (``python -m loadtest.reliability --long``)."""
    return os.environ.get(LONG_ENV, "") not in ("", "0")
