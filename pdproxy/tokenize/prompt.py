"""What a request asks the engine to prefill, read from its OpenAI body.

Three shapes can be hashed faithfully: text (completions), token ids (completions, which skip
tokenization) and chat messages made of text. Anything else (images, audio, prompt embeddings,
batches of several prompts) is :class:`Unhashable` and routes by load alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

_TEXT_PART_TYPES = frozenset({"text", "input_text"})


@dataclass(frozen=True, slots=True)
class TextPrompt:
    text: str
    add_special_tokens: bool = True


@dataclass(frozen=True, slots=True)
class TokenPrompt:
    token_ids: Sequence[int]
    """As the client sent them (not copied); hashing validates them (``InvalidTokensError``)."""


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str
    """Text parts joined with newlines (as vLLM flattens a list of text parts)."""
    extra: tuple[tuple[str, Any], ...] = ()
    parts: tuple[str, ...] | None = None
    """The text parts when the content was a list (the reference worker joins them with "")."""
    """Other keys of the message (name, tool_calls, tool_call_id) for chat templates."""

    def as_template_dict(self) -> dict[str, Any]:
        return {**dict(self.extra), "role": self.role, "content": self.content}


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    messages: tuple[ChatMessage, ...]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: tuple[Any, ...] | None = None
    template_kwargs: tuple[tuple[str, Any], ...] = ()
    add_special_tokens: bool = False


@dataclass(frozen=True, slots=True)
class Unhashable:
    """Why a request cannot be hashed faithfully (``"multimodal"``, ``"prompt-embeds"``...)."""

    reason: str


Prompt = TextPrompt | TokenPrompt | ChatPrompt


def prompt_of(endpoint: str, body: Mapping[str, Any]) -> Prompt | Unhashable:
    """The prompt of a ``"completions"`` or ``"chat"`` request body."""
    if body.get("prompt_embeds") is not None:
        return Unhashable("prompt-embeds")
    if endpoint == "chat":
        return _chat_prompt(body)
    if endpoint == "completions":
        return _completion_prompt(body)
    return Unhashable(f"endpoint-{endpoint}")


def cache_salt_of(body: Mapping[str, Any]) -> str | None:
    salt = body.get("cache_salt")
    return salt if isinstance(salt, str) and salt else None


def prompt_chars(prompt: Prompt, stop_at: int) -> int:
    """A size figure for deciding whether to tokenize off the event loop: the characters of
    everything a chat template can render (roles, contents, the other message keys, tools,
    template kwargs). The walk stops once past ``stop_at``, so measuring stays cheap."""
    if isinstance(prompt, TextPrompt):
        return len(prompt.text)
    if isinstance(prompt, TokenPrompt):
        return len(prompt.token_ids)
    size = 0
    for m in prompt.messages:
        size += len(m.role) + len(m.content)
        if m.extra:
            size = _walk_size(m.extra, size, stop_at)
        if size > stop_at:
            return size
    size = _walk_size(prompt.tools, size, stop_at)
    return _walk_size(prompt.template_kwargs, size, stop_at)


def _walk_size(value: object, size: int, stop_at: int) -> int:
    """``size`` plus the characters of the strings (and one per other scalar) inside ``value``,
    stopping once past ``stop_at``; iterative, so deep nesting cannot exhaust the stack."""
    stack: list[object] = [value]
    while stack and size <= stop_at:
        item = stack.pop()
        if isinstance(item, str):
            size += len(item) + 1
        elif isinstance(item, Mapping):
            for k, v in item.items():
                stack.append(k)
                stack.append(v)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        else:
            size += 1
    return size


def _completion_prompt(body: Mapping[str, Any]) -> Prompt | Unhashable:
    prompt = body.get("prompt")
    add_special = body.get("add_special_tokens", True)
    add_special = add_special if isinstance(add_special, bool) else True
    if isinstance(prompt, str):
        return TextPrompt(prompt, add_special)
    if isinstance(prompt, list):
        if prompt and isinstance(prompt[0], int):
            return TokenPrompt(prompt)
        if len(prompt) != 1:
            return Unhashable("batch" if len(prompt) > 1 else "empty-prompt")
        (only,) = prompt
        if isinstance(only, str):
            return TextPrompt(only, add_special)
        if isinstance(only, list) and only and isinstance(only[0], int):
            return TokenPrompt(only)
    return Unhashable("invalid-prompt")


def _chat_prompt(body: Mapping[str, Any]) -> Prompt | Unhashable:
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        return Unhashable("invalid-messages")
    messages: list[ChatMessage] = []
    for message in raw:
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            return Unhashable("invalid-messages")
        parts = _message_parts(message.get("content"))
        if isinstance(parts, Unhashable):
            return parts
        extra = tuple((k, v) for k, v in message.items() if k not in ("role", "content"))
        content = parts if isinstance(parts, str) else "\n".join(parts)
        listed = None if isinstance(parts, str) else parts
        messages.append(ChatMessage(message["role"], content, extra, listed))
    tools = body.get("tools")
    kwargs = body.get("chat_template_kwargs")
    add_special = body.get("add_special_tokens", False)
    return ChatPrompt(
        messages=tuple(messages),
        add_generation_prompt=bool(body.get("add_generation_prompt", True)),
        continue_final_message=bool(body.get("continue_final_message", False)),
        tools=tuple(tools) if isinstance(tools, list) else None,
        template_kwargs=tuple(kwargs.items()) if isinstance(kwargs, Mapping) else (),
        add_special_tokens=add_special if isinstance(add_special, bool) else False,
    )


def _message_parts(content: object) -> str | tuple[str, ...] | Unhashable:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, Sequence):
        return Unhashable("invalid-messages")
    texts: list[str] = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, Mapping):
            return Unhashable("invalid-messages")
        kind = part.get("type", "text")
        if kind not in _TEXT_PART_TYPES:
            return Unhashable("multimodal")
        text = part.get("text")
        if not isinstance(text, str):
            return Unhashable("invalid-messages")
        texts.append(text)
    return tuple(texts)
