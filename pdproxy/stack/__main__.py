"""``python -m pdproxy.stack``: run the local PD stack."""

from __future__ import annotations

import sys

from pdproxy.stack.cli import main

if __name__ == "__main__":
    sys.exit(main())
