"""The tokenizer contract and the off-loop rule shared by local tokenizers."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Protocol

from pdproxy.tokenize.prompt import ChatPrompt, Prompt, TextPrompt, TokenPrompt, prompt_chars


class Tokenizer(Protocol):
    """Turns text and chat prompts into the token ids the pool's engines will see."""

    async def tokenize(self, prompt: TextPrompt | ChatPrompt) -> Sequence[int]:
        """Raises :class:`~pdproxy.tokenize.errors.TokenizationError` when it cannot."""
        ...

    async def close(self) -> None: ...


class LocalEncoder(Protocol):
    """A tokenizer that runs in this process (synchronous, CPU-bound)."""

    def encode(self, prompt: TextPrompt | ChatPrompt) -> list[int]: ...


class OffLoopTokenizer:
    """A local encoder behind the async contract: inline for short prompts, in a thread above
    ``threshold_chars`` so a long prompt never stalls the event loop."""

    def __init__(self, encoder: LocalEncoder, threshold_chars: int) -> None:
        self._encoder = encoder
        self._threshold = threshold_chars

    async def tokenize(self, prompt: TextPrompt | ChatPrompt) -> Sequence[int]:
        if prompt_chars(prompt, self._threshold) > self._threshold:
            return await asyncio.to_thread(self._encoder.encode, prompt)
        return self._encoder.encode(prompt)

    async def close(self) -> None:
        return None


async def token_ids(tokenizer: Tokenizer, prompt: Prompt) -> Sequence[int]:
    """The prompt's token ids; token-id prompts skip tokenization."""
    if isinstance(prompt, TokenPrompt):
        return prompt.token_ids
    return await tokenizer.tokenize(prompt)
