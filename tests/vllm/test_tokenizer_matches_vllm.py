"""The proxy's Hugging Face tokenizer yields exactly vLLM's token ids (router hashes depend on
it): compared with vLLM's own ``/tokenize`` on the same model directory."""

from __future__ import annotations

import httpx
import pytest

from pdproxy.tokenize.hf import HfEncoder
from pdproxy.tokenize.prompt import ChatMessage, ChatPrompt, TextPrompt
from tests.vllm.conftest import MODEL, VllmStack

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

TEXTS = [
    "The quick brown fox jumps over 1234 lazy dogs!",
    "  leading spaces, trailing tabs\t\t\nand new\nlines  ",
    "héllo wörld — ünïcode, emoji 🙂 and CJK 漢字",
    "<s> looks special </s> but is text",
    "",
]


@pytest.mark.parametrize("text", TEXTS)
def test_completion_text(vllm_stack: VllmStack, text: str) -> None:
    encoder = HfEncoder.from_dir(vllm_stack.paths.model_dir)
    resp = httpx.post(
        vllm_stack.url("r0") + "/tokenize", json={"model": MODEL, "prompt": text}, timeout=30
    )
    resp.raise_for_status()
    assert encoder.encode(TextPrompt(text)) == resp.json()["tokens"]


def test_chat_template(vllm_stack: VllmStack) -> None:
    encoder = HfEncoder.from_dir(vllm_stack.paths.model_dir)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is a prefix cache? ünïcode 🙂"},
        {"role": "assistant", "content": "A store of KV blocks."},
        {"role": "user", "content": "And PD?"},
    ]
    resp = httpx.post(
        vllm_stack.url("r0") + "/tokenize",
        json={"model": MODEL, "messages": messages, "add_generation_prompt": True},
        timeout=30,
    )
    resp.raise_for_status()
    prompt = ChatPrompt(tuple(ChatMessage(m["role"], m["content"]) for m in messages))
    assert encoder.encode(prompt) == resp.json()["tokens"]
