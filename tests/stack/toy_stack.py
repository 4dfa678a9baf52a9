"""Runs pdproxy.stack's serve loop over toy services (for signal tests, as a subprocess).

python toy_stack.py READY_FILE RUN_DIR [--grandchild-pid-file F]
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pdproxy.stack.cli import serve_stack, stop_on_signals  # noqa: E402
from pdproxy.stack.plan import StackOptions, StackPlan  # noqa: E402
from tests.stack.conftest import toy_spec  # noqa: E402


def main() -> int:
    ready, run_dir = Path(sys.argv[1]), Path(sys.argv[2])
    option = sys.argv[3] if len(sys.argv) > 3 else None
    if option == "--slow":  # never healthy in time: the stack is stopped while starting
        extra = ["--delay", "60"]
    elif option is not None:
        extra = ["--grandchild", "--pid-file", option]
    else:
        extra = []
    workers = (toy_spec("p0", role="producer"), toy_spec("c0", *extra, role="consumer"))
    proxy = toy_spec("proxy", role="proxy")
    plan = StackPlan(
        options=StackOptions(),
        workers=workers,
        proxy=proxy,
        proxy_config={},
        config_path=run_dir / "proxy.yaml",
        endpoint=proxy.health_url.removesuffix("/health") if proxy.health_url else "",
        model_name="toy",
    )
    stop = threading.Event()
    with stop_on_signals(stop):
        return serve_stack(
            plan,
            run_dir / "logs",
            stop=stop,
            startup_timeout_s=30,
            status_interval_s=0.2,
            ready_file=ready,
            out=sys.stdout,
        )


if __name__ == "__main__":
    sys.exit(main())
