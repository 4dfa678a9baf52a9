"""The backend's own ``POST /tokenize`` (vLLM's shape): the engine tokenizes for us.

One extra round trip per request, so it is the fallback for models whose tokenizer the proxy
cannot load. Every call is bounded by a timeout; failures raise
:class:`~pdproxy.tokenize.errors.TokenizerUnavailable` and the router routes by load alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import aiohttp

from pdproxy.tokenize.errors import TokenizerUnavailable
from pdproxy.tokenize.prompt import ChatPrompt, TextPrompt


class BackendTokenizer:
    def __init__(self, base_url: str, model: str | None, timeout_s: float) -> None:
        self._url = base_url.rstrip("/") + "/tokenize"
        self._model = model
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    def _body(self, prompt: TextPrompt | ChatPrompt) -> dict[str, Any]:
        body: dict[str, Any] = {} if self._model is None else {"model": self._model}
        if isinstance(prompt, TextPrompt):
            body.update(prompt=prompt.text, add_special_tokens=prompt.add_special_tokens)
            return body
        body.update(
            messages=[m.as_template_dict() for m in prompt.messages],
            add_generation_prompt=prompt.add_generation_prompt,
            continue_final_message=prompt.continue_final_message,
            add_special_tokens=prompt.add_special_tokens,
        )
        if prompt.tools is not None:
            body["tools"] = list(prompt.tools)
        if prompt.template_kwargs:
            body["chat_template_kwargs"] = dict(prompt.template_kwargs)
        return body

    async def tokenize(self, prompt: TextPrompt | ChatPrompt) -> Sequence[int]:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        try:
            async with self._session.post(self._url, json=self._body(prompt)) as resp:
                if resp.status != 200:
                    raise TokenizerUnavailable(f"{self._url} answered {resp.status}")
                data = await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise TokenizerUnavailable(f"{self._url} failed: {exc!r}") from exc
        tokens = data.get("tokens") if isinstance(data, dict) else None
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise TokenizerUnavailable(f"{self._url} returned no token list")
        return tokens

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
