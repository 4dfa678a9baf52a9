"""The reference worker's tokenizer: UTF-8 bytes as token ids, and its minimal chat template.

Must agree byte for byte with ``kvtier.worker.tokenizer.ByteTokenizer`` (a test compares them);
it is restated here because the proxy never imports the worker.
"""

from __future__ import annotations

from pdproxy.tokenize.errors import TokenizationError
from pdproxy.tokenize.prompt import ChatMessage, ChatPrompt, TextPrompt


def render_chat(prompt: ChatPrompt) -> str:
    """``<|role|>\\ncontent\\n`` per message, then the assistant's header (text parts of a
    message are joined with nothing between them, as the worker joins them)."""
    parts = [f"<|{m.role}|>\n{_text(m)}\n" for m in prompt.messages]
    if prompt.continue_final_message and parts:  # the worker leaves the last message open
        parts[-1] = parts[-1][:-1]
    elif prompt.add_generation_prompt:
        parts.append("<|assistant|>\n")
    return "".join(parts)


class ByteEncoder:
    """Token ``b`` is byte ``b`` of the UTF-8 text; no special tokens."""

    def encode(self, prompt: TextPrompt | ChatPrompt) -> list[int]:
        text = prompt.text if isinstance(prompt, TextPrompt) else render_chat(prompt)
        try:
            return list(text.encode("utf-8"))
        except UnicodeEncodeError as exc:  # lone surrogates (JSON "\ud800"): the worker refuses
            raise TokenizationError(f"text is not valid Unicode: {exc.reason}") from exc


def _text(message: ChatMessage) -> str:
    return message.content if message.parts is None else "".join(message.parts)
