"""The byte tokenizer of both backends: token ``b`` is byte ``b``; 256 is end of sequence."""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from kvtier.worker.errors import InvalidRequest

BYTE_TOKENS = 256


class ByteTokenizer:
    """UTF-8 bytes as tokens, with a minimal chat template."""

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text``; raises :class:`InvalidRequest` for text that has none
        (lone surrogates, which JSON escapes such as ``"\\ud800"`` can carry)."""
        try:
            return list(text.encode("utf-8"))
        except UnicodeEncodeError as exc:
            raise InvalidRequest(
                f"text is not valid Unicode (lone surrogate at position {exc.start})",
                param="prompt",
            ) from exc

    def decode(self, token_ids: Sequence[int]) -> str:
        return bytes(t for t in token_ids if t < BYTE_TOKENS).decode("utf-8", errors="replace")

    def apply_chat_template(
        self,
        messages: Sequence[tuple[str, str]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> str:
        """``<|role|>\\ncontent\\n`` per message, then the assistant's header.

        ``continue_final_message`` (vLLM's extension): the last message is left open, its
        content verbatim and unterminated, and no header follows, so generation continues it
        (``prompt + generated`` renders as the uninterrupted prompt did, plus the text)."""
        parts = [f"<|{role}|>\n{content}\n" for role, content in messages]
        if continue_final_message and parts:
            parts[-1] = parts[-1][:-1]
        elif add_generation_prompt:
            parts.append("<|assistant|>\n")
        return "".join(parts)


class IncrementalDetokenizer:
    """Turns a stream of byte tokens into text, holding back split UTF-8 sequences."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        if token_id >= BYTE_TOKENS:
            return ""
        return str(self._decoder.decode(bytes([token_id])))

    def flush(self) -> str:
        return str(self._decoder.decode(b"", final=True))
