"""A trivial service for supervisor tests (run as a subprocess).

    python toy_service.py --port N [--delay S] [--ignore-term] [--exit-after S] [--grandchild]

Answers ``GET /health`` with ``{"status": "ok", "port": N}`` after ``--delay`` seconds.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = json.dumps({"status": "ok", "port": self.server.server_address[1]}).encode()
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--ignore-term", action="store_true")
    parser.add_argument("--exit-after", type=float, default=None)
    parser.add_argument("--grandchild", action="store_true")
    parser.add_argument("--pid-file", default=None)
    args = parser.parse_args()
    if args.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.grandchild:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        if args.pid_file:
            with open(args.pid_file, "w") as f:
                f.write(str(child.pid))
    print(f"toy service on {args.port}", flush=True)
    time.sleep(args.delay)
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    if args.exit_after is not None:
        time.sleep(args.exit_after)
        print("toy service giving up", flush=True)
        sys.exit(3)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
