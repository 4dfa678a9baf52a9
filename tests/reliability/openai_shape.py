"""Checks that an HTTP answer is a well-formed OpenAI error or a valid completion (or stream)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import orjson

ALLOWED_ERROR_STATUSES = frozenset({400, 401, 403, 404, 405, 413, 415, 422, 429, 503})


class MalformedAnswer(AssertionError):
    """The server answered something that is neither a valid answer nor an OpenAI error."""


def check_error_body(status: int, raw: bytes) -> None:
    if status >= 500 and status != 503:
        raise MalformedAnswer(f"status {status}: {raw[:300]!r}")
    if status not in ALLOWED_ERROR_STATUSES:
        raise MalformedAnswer(f"unexpected status {status}: {raw[:300]!r}")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise MalformedAnswer(f"status {status}, body is not JSON: {raw[:300]!r}") from exc
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict):
        raise MalformedAnswer(f"status {status}, no error object: {raw[:300]!r}")
    if not isinstance(err.get("message"), str) or not isinstance(err.get("type"), str):
        raise MalformedAnswer(f"status {status}, error without message/type: {err!r}")
    if "code" not in err:
        raise MalformedAnswer(f"status {status}, error without code: {err!r}")


def check_completion(raw: bytes, *, chat: bool) -> dict[str, Any]:
    body = orjson.loads(raw)
    if not isinstance(body, dict) or not isinstance(body.get("choices"), list):
        raise MalformedAnswer(f"200 without choices: {raw[:300]!r}")
    for choice in body["choices"]:
        if chat:
            if not isinstance(choice.get("message", {}).get("content"), str):
                raise MalformedAnswer(f"chat choice without content: {choice!r}")
        elif not isinstance(choice.get("text"), str):
            raise MalformedAnswer(f"completion choice without text: {choice!r}")
    return body


def check_stream(raw: bytes) -> int:
    """A complete SSE stream: JSON data events, then ``[DONE]``; returns the data events.

    An ``error`` event is allowed (it ends the stream); a stream without ``[DONE]`` is not.
    """
    events = 0
    done = False
    for line in raw.split(b"\n"):
        if not line.strip():
            continue
        if not line.startswith(b"data: "):
            raise MalformedAnswer(f"stream line is not an SSE data line: {line[:200]!r}")
        data = line.removeprefix(b"data: ")
        if done:
            raise MalformedAnswer("data after [DONE]")
        if data == b"[DONE]":
            done = True
            continue
        try:
            event = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise MalformedAnswer(f"stream event is not JSON: {data[:200]!r}") from exc
        if not isinstance(event, dict) or not ("choices" in event or "error" in event):
            raise MalformedAnswer(f"stream event of no known shape: {data[:200]!r}")
        events += 1
    if not done:
        raise MalformedAnswer(f"stream ended without [DONE]: {raw[-300:]!r}")
    return events


def check_answer(status: int, raw: bytes, content_type: str, *, chat: bool) -> str:
    """``"ok"``, ``"stream"`` or ``"error"``; raises :class:`MalformedAnswer` otherwise."""
    if status != 200:
        check_error_body(status, raw)
        return "error"
    if content_type.startswith("text/event-stream"):
        check_stream(raw)
        return "stream"
    check_completion(raw, chat=chat)
    return "ok"


ANSWER_TIMEOUT_S = 15.0
"""A fuzzed request must be answered within this; a hang is a failure."""


async def post_and_classify(
    client: httpx.AsyncClient,
    path: str,
    content: bytes,
    headers: dict[str, str],
    kinds: dict[str, int],
) -> None:
    """POST one fuzzed body, check the answer's shape, and count its kind in ``kinds``."""
    async with asyncio.timeout(ANSWER_TIMEOUT_S):
        resp = await client.post(
            path, content=content, headers={"content-type": "application/json", **headers}
        )
    kind = check_answer(
        resp.status_code,
        resp.content,
        resp.headers.get("content-type", ""),
        chat=path.endswith("chat/completions"),
    )
    kinds[kind] = kinds.get(kind, 0) + 1
