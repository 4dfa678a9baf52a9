"""Which model an OpenAI server serves (``GET /v1/models``), for load tests without ``--model``."""

from __future__ import annotations

import json
import urllib.request


class NoModelServed(RuntimeError):
    """The server's model list could not be read or was empty."""


def served_model(base_url: str, api_key: str | None = None, timeout_s: float = 10.0) -> str:
    """The first model id that ``GET {base_url}/v1/models`` lists."""
    request = urllib.request.Request(base_url.rstrip("/") + "/v1/models")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            doc = json.loads(resp.read())
    except (OSError, ValueError) as exc:
        raise NoModelServed(f"cannot list models at {base_url}: {exc}") from exc
    models = doc.get("data") if isinstance(doc, dict) else None
    if not models or not isinstance(models[0], dict) or "id" not in models[0]:
        raise NoModelServed(f"{base_url}/v1/models lists no model")
    return str(models[0]["id"])
