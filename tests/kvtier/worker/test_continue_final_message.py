"""The worker continues a final assistant message (vLLM's ``continue_final_message``): the
continuation of an answer cut after k tokens is the rest of the uninterrupted answer, for both
backends. This is what the proxy's mid-stream failover sends (``pdproxy.request.continuation``)."""

from __future__ import annotations

import pytest

from kvtier.worker.tokenizer import ByteTokenizer
from pdproxy.tokenize.byte_level import ByteEncoder
from pdproxy.tokenize.prompt import prompt_of

from .conftest import running_worker, small_settings

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Tell me about blocks of sixteen tokens."},
]


@pytest.mark.parametrize("model", ["sim", "tiny"])
async def test_a_cut_answer_continues_exactly(model: str) -> None:
    async with running_worker(small_settings(model=model)) as w:
        body = {"messages": MESSAGES, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        whole = (await w.client.post("/v1/chat/completions", json=body)).json()
        answer = whole["choices"][0]["message"]["content"]
        assert len(answer) == 12
        for k in (1, 5, 11):
            cont = {
                **body,
                "messages": [*MESSAGES, {"role": "assistant", "content": answer[:k]}],
                "continue_final_message": True,
                "add_generation_prompt": False,
                "max_tokens": 12 - k,
            }
            resp = await w.client.post("/v1/chat/completions", json=cont)
            assert resp.status_code == 200, resp.text
            rest = resp.json()
            assert rest["choices"][0]["message"]["content"] == answer[k:]
            assert rest["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"] + k


async def test_continue_final_message_needs_an_assistant_message_and_no_generation_prompt() -> None:
    async with running_worker(small_settings(model="sim")) as w:
        both = {"messages": [*MESSAGES, {"role": "assistant", "content": "x"}],
                "continue_final_message": True}  # fmt: skip
        resp = await w.client.post("/v1/chat/completions", json=both)
        assert resp.status_code == 400 and "add_generation_prompt" in resp.text
        user_last = {"messages": MESSAGES, "continue_final_message": True,
                     "add_generation_prompt": False}  # fmt: skip
        resp = await w.client.post("/v1/chat/completions", json=user_last)
        assert resp.status_code == 400 and "assistant" in resp.text


@pytest.mark.parametrize(
    "flags",
    [
        {"add_generation_prompt": False},
        {"continue_final_message": True, "add_generation_prompt": False},
    ],
)
def test_the_proxys_byte_encoder_renders_as_the_worker(flags: dict[str, bool]) -> None:
    messages = [*MESSAGES, {"role": "assistant", "content": "So far"}]
    body = {"messages": messages, **flags}
    prompt = prompt_of("chat", body)
    worker = ByteTokenizer()
    rendered = worker.apply_chat_template(
        [(m["role"], m["content"]) for m in messages],
        add_generation_prompt=flags.get("add_generation_prompt", True),
        continue_final_message=flags.get("continue_final_message", False),
    )
    assert ByteEncoder().encode(prompt) == worker.encode(rendered)  # type: ignore[arg-type]
