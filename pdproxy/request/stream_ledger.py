"""What a client's SSE stream has received so far, event by event (mid-stream failover).

A consumer's stream arrives in transport chunks that need not end on an event boundary. For a
stream that may migrate (:mod:`pdproxy.request.failover`) the relay forwards whole events only
(:class:`EventSplitter`), so a consumer dying in the middle of an event never leaves half an
event at the client, and :class:`StreamLedger` records what the client has seen: the response's
``id``/``created``/``model``, the generated text (and token ids when the consumer sent them),
the token counts from the consumer's usage, and whether every choice finished.

:class:`ChunkShaper` turns one consumer chunk into the chunk the client gets: the first leg's
chunks are passed through except for the usage the proxy asked for on the client's behalf; a
continuation leg's chunks take the first leg's identity and the request's real token counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

DONE_EVENT = b"data: [DONE]\n\n"
MAX_EVENT_BYTES = 4 * 1024 * 1024
"""An SSE event longer than this (no blank line yet) is not a stream a ledger can follow."""


class StreamNotFollowable(Exception):
    """The stream's framing cannot be followed event by event (an event past the size cap)."""


class EventSplitter:
    """Transport chunks in, whole SSE events (each ending in a blank line) out.

    An unfinished event waits in a bytearray (appending is amortised O(1)) with how far it was
    already searched for its blank line, so each read scans its own bytes only: one event of
    4 MiB read 1 KiB at a time costs one pass over it, not one pass per read (7.7 s of CPU)."""

    __slots__ = ("_pending", "_scanned")

    def __init__(self) -> None:
        self._pending = bytearray()
        self._scanned = 0
        """Bytes of ``_pending`` known to hold no blank line (but maybe its first ``\n``)."""

    def feed(self, chunk: bytes) -> list[bytes]:
        pending = self._pending
        if not pending:
            return self._split(chunk)  # the usual read: whole events, nothing copied
        pending += chunk
        end = pending.find(b"\n\n", max(self._scanned - 1, 0))  # may straddle two reads
        if end < 0:
            self._scanned = len(pending)
            self._check()
            return []
        first = bytes(pending[: end + 2])
        rest = bytes(pending[end + 2 :])
        pending.clear()
        return [first, *self._split(rest)]

    def _split(self, data: bytes) -> list[bytes]:
        events: list[bytes] = []
        start = 0
        while True:
            end = data.find(b"\n\n", start)
            if end < 0:
                break
            events.append(data[start : end + 2])
            start = end + 2
        if start < len(data):
            self._pending += data[start:]
            self._scanned = len(self._pending)
            self._check()
        return events

    def _check(self) -> None:
        if len(self._pending) > MAX_EVENT_BYTES:
            raise StreamNotFollowable("an SSE event is longer than the cap")

    @property
    def partial(self) -> bool:
        """Bytes of an unfinished event are waiting (dropped if the consumer dies now)."""
        return bool(self._pending.strip())


def event_data(event: bytes) -> bytes | None:
    """The payload of an event's ``data:`` line(s); None for comments and other fields."""
    if event.startswith(b"data: ") and event.find(b"\n") == len(event) - 2:
        return event[6:-2]  # one data line: what engines send
    lines = [ln for ln in event.split(b"\n") if ln.startswith(b"data:")]
    if not lines:
        return None
    return b"\n".join(ln[5:].removeprefix(b" ") for ln in lines)


@dataclass(slots=True)
class StreamLedger:
    """What the client has received of one streamed answer."""

    identity: dict[str, Any] = field(default_factory=dict)
    """``id``, ``created``, ``model`` (and ``system_fingerprint``) of the first chunk."""
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    token_ids_complete: bool = True
    """Every content chunk so far carried ``token_ids`` (then they are exact)."""
    prompt_token_ids: list[int] | None = None
    """The prompt as the first consumer tokenized it (chat: its template rendered), when it
    sent them (``return_token_ids``)."""
    prompt_tokens: int | None = None
    """The original prompt's token count (from the first leg's usage)."""
    completion_tokens: int = 0
    """Tokens generated and relayed to the client so far, over every leg."""
    counted: bool = False
    """The consumer reported its running token count (``continuous_usage_stats``): without
    it the tokens already generated are not known exactly and the stream cannot migrate."""
    finished: bool = False
    usage_sent: bool = False
    done_sent: bool = False
    role_sent: bool = False
    cached_tokens: int | None = None

    @property
    def generated_text(self) -> str:
        return "".join(self.text)

    def exact_ids(self, done: int) -> list[int] | None:
        """The prompt's ids then the ``done`` generated ids the client received; None unless
        every one of them is known."""
        if self.prompt_token_ids is None or not self.token_ids_complete:
            return None
        if len(self.token_ids) != done:
            return None
        return [*self.prompt_token_ids, *self.token_ids]


def _choice(chunk: dict[str, Any]) -> dict[str, Any] | None:
    choices = chunk.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        return choices[0]
    return None


def _choice_text(choice: dict[str, Any]) -> str:
    delta = choice.get("delta")
    if isinstance(delta, dict):
        content = delta.get("content")
        return content if isinstance(content, str) else ""
    text = choice.get("text")
    return text if isinstance(text, str) else ""


class ChunkShaper:
    """Rewrites one leg's chunks for the client and records them in the ledger.

    ``base_tokens``: tokens generated by earlier legs (0 for the first leg); a continuation
    leg's prompt holds them, so its usage is shifted back: prompt = the original prompt,
    completion = every token generated.
    """

    __slots__ = ("_base", "_client_ids", "_client_usage", "_continuation", "_continuous", "ledger")

    def __init__(
        self,
        ledger: StreamLedger,
        *,
        continuation: bool,
        client_usage: bool,
        client_continuous: bool,
        client_token_ids: bool = False,
    ) -> None:
        self.ledger = ledger
        self._continuation = continuation
        self._base = ledger.completion_tokens
        self._client_usage = client_usage
        self._continuous = client_continuous
        self._client_ids = client_token_ids

    def shape(self, chunk: dict[str, Any]) -> bytes | None:
        """The event to send for ``chunk`` (None: nothing to send)."""
        ledger = self.ledger
        usage = chunk.get("usage")
        choice = _choice(chunk)
        if isinstance(usage, dict):
            self._observe_usage(usage)
        # vLLM sends the prompt's ids once: chat at the chunk's top level, completions in the
        # choice. A continuation's prompt ids include generated tokens: never the client's.
        self._take_prompt_ids(chunk)
        if choice is not None:
            self._take_prompt_ids(choice)
        if self._continuation:
            for name, value in ledger.identity.items():
                if name in chunk:
                    chunk[name] = value
        elif not ledger.identity:
            ledger.identity = {
                k: chunk[k] for k in ("id", "created", "model", "system_fingerprint") if k in chunk
            }
        if choice is None:  # a usage chunk (or an empty one)
            if not isinstance(usage, dict) or not self._client_usage or ledger.usage_sent:
                return None
            chunk["usage"] = self.client_usage()
            ledger.usage_sent = True
            return b"data: " + orjson.dumps(chunk) + b"\n\n"
        delta = choice.get("delta")
        if isinstance(delta, dict) and "role" in delta and not delta.get("content"):
            if ledger.role_sent:
                return None  # a continuation's own opening: the client has one already
            ledger.role_sent = True
        text = _choice_text(choice)
        if text:
            ledger.text.append(text)
        ids = choice.get("token_ids")
        if isinstance(ids, list):
            ledger.token_ids.extend(t for t in ids if isinstance(t, int))
            if not self._client_ids:
                del choice["token_ids"]
        elif text:
            ledger.token_ids_complete = False
        if choice.get("finish_reason") is not None:
            ledger.finished = True
        if "usage" in chunk:
            chunk["usage"] = self.client_usage() if self._continuous and usage else None
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

    def _take_prompt_ids(self, where: dict[str, Any]) -> None:
        if "prompt_token_ids" not in where:
            return
        ids = where["prompt_token_ids"]
        if self._continuation or not self._client_ids:
            del where["prompt_token_ids"]
        if self._continuation or self.ledger.prompt_token_ids is not None:
            return
        if isinstance(ids, list) and ids and all(type(t) is int for t in ids):
            self.ledger.prompt_token_ids = ids

    def _observe_usage(self, usage: dict[str, Any]) -> None:
        ledger = self.ledger
        prompt = usage.get("prompt_tokens")
        completion = usage.get("completion_tokens")
        if isinstance(completion, int):
            ledger.completion_tokens = self._base + completion
            ledger.counted = True
        if isinstance(prompt, int) and ledger.prompt_tokens is None and not self._continuation:
            ledger.prompt_tokens = prompt
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if isinstance(cached, int) and not self._continuation:
            ledger.cached_tokens = cached

    def client_usage(self) -> dict[str, Any]:
        """Usage as the uninterrupted stream would have reported it."""
        ledger = self.ledger
        prompt = ledger.prompt_tokens or 0
        usage: dict[str, Any] = {
            "prompt_tokens": prompt,
            "completion_tokens": ledger.completion_tokens,
            "total_tokens": prompt + ledger.completion_tokens,
        }
        if ledger.cached_tokens is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": ledger.cached_tokens}
        return usage

    def closing_events(self) -> bytes:
        """The usage chunk (if the client asked and has none) and ``[DONE]``, for a stream
        whose every choice finished but whose consumer went before saying so."""
        ledger = self.ledger
        out = b""
        if self._client_usage and not ledger.usage_sent:
            chunk = {**ledger.identity, "object": self._object_name(), "choices": []}
            chunk["usage"] = self.client_usage()
            ledger.usage_sent = True
            out += b"data: " + orjson.dumps(chunk) + b"\n\n"
        if not ledger.done_sent:
            ledger.done_sent = True
            out += DONE_EVENT
        return out

    def _object_name(self) -> str:
        ident = str(self.ledger.identity.get("id", ""))
        return "chat.completion.chunk" if ident.startswith("chatcmpl") else "text_completion"
