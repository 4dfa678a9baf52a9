"""Per-request timing of OpenAI responses: SSE decoding, chunk timing, error classes.

Transport-neutral: the caller (asyncio client or Locust's gevent client) reads bytes, stamps
them with ``time.perf_counter()`` and feeds them here; a :class:`RequestRecord` comes out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class ErrorKind(StrEnum):
    CONNECT = "connect"
    """The connection could not be opened or was reset before a response."""
    TIMEOUT = "timeout"
    RATE_LIMITED = "http_429"
    CLIENT_ERROR = "http_4xx"
    SERVER_ERROR = "http_5xx"
    STREAM_ERROR = "stream_error"
    """An ``error`` object inside a 200 stream."""
    TRUNCATED = "truncated"
    """The stream ended without ``[DONE]`` (connection cut mid-answer)."""
    BAD_RESPONSE = "bad_response"
    """A body that is not the JSON an OpenAI server returns."""
    EMPTY = "empty"
    """A successful response that generated no text and reported no tokens."""


def classify_status(status: int) -> ErrorKind | None:
    if status < 400:
        return None
    if status == 429:
        return ErrorKind.RATE_LIMITED
    if status < 500:
        return ErrorKind.CLIENT_ERROR
    return ErrorKind.SERVER_ERROR


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """What one request measured. Times are seconds; ``start_s`` is on the run's clock."""

    tag: str
    start_s: float
    e2el_s: float
    ok: bool
    error: ErrorKind | None = None
    error_detail: str = ""
    ttft_s: float | None = None
    itl_s: tuple[float, ...] = ()
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    """``usage.prompt_tokens_details.cached_tokens`` when the server reports it."""
    text: str = ""
    streamed: bool = True
    """False for non-streaming answers, which have no TPOT or ITL."""

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (None with fewer than two tokens)."""
        if not self.ok or not self.streamed or self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1)


def failed(tag: str, start: float, end: float, kind: ErrorKind, detail: str) -> RequestRecord:
    return RequestRecord(
        tag=tag, start_s=start, e2el_s=end - start, ok=False, error=kind, error_detail=detail[:300]
    )


class SSEDecoder:
    """Incremental ``text/event-stream`` decoder yielding each event's ``data`` payload."""

    __slots__ = ("_buffer", "_data")

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        self._buffer += chunk
        events: list[str] = []
        while True:
            nl = self._buffer.find(b"\n")
            if nl < 0:
                return events
            line = self._buffer[:nl].rstrip(b"\r").decode("utf-8", errors="replace")
            self._buffer = self._buffer[nl + 1 :]
            if not line:
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
            elif line.startswith("data:"):
                self._data.append(line[5:].removeprefix(" "))
            # Comments (":") and other fields (event:, id:, retry:) carry no tokens.

    def flush(self) -> list[str]:
        """Events left when the connection closed without a final blank line."""
        rest = self.feed(b"\n\n") if self._buffer or self._data else []
        return rest


def _cached(usage: dict[str, Any]) -> int:
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict):
        return int(details.get("cached_tokens") or 0)
    return 0


def _choice_text(choice: dict[str, Any]) -> str:
    if "delta" in choice:
        delta = choice.get("delta") or {}
        return str(delta.get("content") or "") + str(delta.get("reasoning_content") or "")
    if "message" in choice:
        message = choice.get("message") or {}
        return str(message.get("content") or "")
    return str(choice.get("text") or "")


@dataclass(slots=True)
class StreamTimer:
    """Builds a :class:`RequestRecord` from SSE payloads stamped with their arrival time."""

    tag: str
    start: float
    expected_prompt_tokens: int = 0
    _first: float | None = None
    _last: float | None = None
    _itl: list[float] = field(default_factory=list)
    _chunks: int = 0
    _text: list[str] = field(default_factory=list)
    _usage: dict[str, Any] | None = None
    _done: bool = False
    _error: str | None = None
    _undecodable: int = 0

    def on_payload(self, payload: str, now: float) -> None:
        if payload == "[DONE]":
            self._done = True
            return
        try:
            chunk = json.loads(payload)
        except ValueError:
            self._undecodable += 1
            return
        if not isinstance(chunk, dict):
            self._undecodable += 1
            return
        if "error" in chunk:
            self._error = json.dumps(chunk["error"])[:300]
            return
        if isinstance(chunk.get("usage"), dict):
            self._usage = chunk["usage"]
        text = "".join(_choice_text(c) for c in chunk.get("choices") or [] if isinstance(c, dict))
        if not text:
            return
        if self._first is None:
            self._first = now
        elif self._last is not None:
            self._itl.append(now - self._last)
        self._last = now
        self._chunks += 1
        self._text.append(text)

    def finish(self, now: float) -> RequestRecord:
        if self._error is not None:
            return failed(self.tag, self.start, now, ErrorKind.STREAM_ERROR, self._error)
        if not self._done:
            return failed(self.tag, self.start, now, ErrorKind.TRUNCATED, "no [DONE]")
        if self._undecodable and self._chunks == 0:
            return failed(self.tag, self.start, now, ErrorKind.BAD_RESPONSE, "undecodable chunks")
        usage = self._usage or {}
        output_tokens = int(usage.get("completion_tokens") or self._chunks)
        if output_tokens == 0:
            return failed(self.tag, self.start, now, ErrorKind.EMPTY, "no tokens")
        return RequestRecord(
            tag=self.tag,
            start_s=self.start,
            e2el_s=now - self.start,
            ok=True,
            ttft_s=None if self._first is None else self._first - self.start,
            itl_s=tuple(self._itl),
            prompt_tokens=int(usage.get("prompt_tokens") or self.expected_prompt_tokens),
            output_tokens=output_tokens,
            cached_tokens=_cached(usage),
            text="".join(self._text),
        )


def record_from_json(
    tag: str, start: float, now: float, body: bytes, expected_prompt_tokens: int = 0
) -> RequestRecord:
    """A non-streaming answer: TTFT is the whole latency (the first token arrives last)."""
    try:
        doc = json.loads(body)
    except ValueError:
        return failed(tag, start, now, ErrorKind.BAD_RESPONSE, body[:200].decode(errors="replace"))
    if not isinstance(doc, dict) or not isinstance(doc.get("choices"), list):
        return failed(tag, start, now, ErrorKind.BAD_RESPONSE, str(doc)[:200])
    text = "".join(_choice_text(c) for c in doc["choices"] if isinstance(c, dict))
    raw_usage = doc.get("usage")
    usage: dict[str, Any] = raw_usage if isinstance(raw_usage, dict) else {}
    output_tokens = int(usage.get("completion_tokens") or (1 if text else 0))
    if output_tokens == 0:
        return failed(tag, start, now, ErrorKind.EMPTY, "no tokens")
    return RequestRecord(
        tag=tag,
        start_s=start,
        e2el_s=now - start,
        ok=True,
        ttft_s=now - start,
        prompt_tokens=int(usage.get("prompt_tokens") or expected_prompt_tokens),
        output_tokens=output_tokens,
        cached_tokens=_cached(usage),
        text=text,
        streamed=False,
    )
