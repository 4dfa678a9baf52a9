"""Hugging Face chat templates rendered with jinja2, the way ``transformers`` renders them.

Same environment (sandboxed, ``trim_blocks``, ``lstrip_blocks``, loop controls), the same helpers
(``raise_exception``, ``strftime_now``, a ``tojson`` that keeps non-ASCII), the same variables
(``messages``, ``tools``, ``add_generation_prompt``, the special tokens, extra template kwargs), so
the router hashes exactly the text the engine tokenizes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pdproxy.tokenize.errors import TokenizationError, TokenizerUnavailable
from pdproxy.tokenize.prompt import ChatPrompt

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token")


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """A compiled template plus the special tokens it may reference."""

    def __init__(self, templates: Mapping[str, str], special_tokens: Mapping[str, str]) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._compiled = {name: env.from_string(src) for name, src in templates.items()}
        except jinja2.TemplateError as exc:
            raise TokenizerUnavailable(f"chat template does not compile: {exc}") from exc
        if "default" not in self._compiled:
            raise TokenizerUnavailable("no default chat template")
        self._special = dict(special_tokens)

    @classmethod
    def from_pretrained_dir(cls, path: Path) -> ChatTemplate | None:
        """From ``tokenizer_config.json`` (and ``chat_template.jinja`` when present)."""
        config = _read_json(path / "tokenizer_config.json")
        special = {k: v for k in _SPECIAL_TOKEN_KEYS if (v := _token_text(config.get(k)))}
        templates: dict[str, str] = {}
        raw = config.get("chat_template")
        if isinstance(raw, str):
            templates["default"] = raw
        elif isinstance(raw, list):
            for entry in raw:
                if isinstance(entry, Mapping) and isinstance(entry.get("template"), str):
                    templates[str(entry.get("name", "default"))] = entry["template"]
        jinja_file = path / "chat_template.jinja"
        if jinja_file.is_file():
            templates["default"] = jinja_file.read_text(encoding="utf-8")
        return cls(templates, special) if templates else None

    def render(self, prompt: ChatPrompt) -> str:
        name = "tool_use" if prompt.tools and "tool_use" in self._compiled else "default"
        variables: dict[str, Any] = {
            **self._special,
            "messages": [m.as_template_dict() for m in prompt.messages],
            "tools": list(prompt.tools) if prompt.tools is not None else None,
            "add_generation_prompt": prompt.add_generation_prompt
            and not prompt.continue_final_message,
            **dict(prompt.template_kwargs),
        }
        try:
            text = self._compiled[name].render(**variables)
        except jinja2.TemplateError as exc:
            raise TokenizationError(f"chat template refused the messages: {exc}") from exc
        if prompt.continue_final_message and prompt.messages:
            final = prompt.messages[-1].content.strip()
            cut = text.rfind(final)
            if final and cut >= 0:
                text = text[: cut + len(final)]
        return text


def _token_text(value: object) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise TokenizerUnavailable(f"cannot read {path}: {exc}") from exc
    return data if isinstance(data, dict) else {}
