"""A local Hugging Face tokenizer (``tokenizer.json``) with its chat template."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as HfTokenizerFile

from pdproxy.tokenize.chat_template import ChatTemplate
from pdproxy.tokenize.errors import TokenizationError, TokenizerUnavailable
from pdproxy.tokenize.prompt import ChatPrompt, TextPrompt


class HfEncoder:
    """Encodes text as ``tokenizer(text)`` does, and chat as ``apply_chat_template`` does:
    render the template, then tokenize without adding special tokens (the template has them)."""

    def __init__(self, tokenizer: HfTokenizerFile, template: ChatTemplate | None) -> None:
        self._tokenizer = tokenizer
        self._template = template

    @classmethod
    def from_dir(cls, path: str | Path) -> HfEncoder:
        root = Path(path)
        try:
            tokenizer = HfTokenizerFile.from_file(str(root / "tokenizer.json"))
        except Exception as exc:  # the Rust side raises plain Exception
            raise TokenizerUnavailable(f"cannot load {root / 'tokenizer.json'}: {exc}") from exc
        return cls(tokenizer, ChatTemplate.from_pretrained_dir(root))

    def encode(self, prompt: TextPrompt | ChatPrompt) -> list[int]:
        if isinstance(prompt, TextPrompt):
            text, add_special = prompt.text, prompt.add_special_tokens
        else:
            if self._template is None:
                raise TokenizationError("this tokenizer has no chat template")
            text, add_special = self._template.render(prompt), prompt.add_special_tokens
        try:
            ids: list[int] = self._tokenizer.encode(text, add_special_tokens=add_special).ids
        except Exception as exc:  # the Rust side raises plain exceptions (e.g. bad Unicode)
            raise TokenizationError(f"tokenizer refused the text: {exc}") from exc
        return ids
