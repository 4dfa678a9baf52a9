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


async def test_a_stream_gives_its_prompt_ids_once_and_chat_reuses_them() -> None:
    """vLLM 0.32's shapes: with ``return_token_ids`` a stream carries the prompt's ids once
    (chat: the role chunk's top level; completions: the first choice) and each token's ids;
    chat's ``kv_transfer_params.prompt_token_ids`` replaces the rendered messages. A failover
    continuation from those ids is the rest of the uninterrupted answer."""
    import orjson

    async def events(w: object, path: str, body: dict[str, object]) -> list[dict[str, object]]:
        resp = await w.client.post(path, json={**body, "stream": True})  # type: ignore[attr-defined]
        assert resp.status_code == 200, resp.text
        return [
            orjson.loads(line[6:]) for line in resp.text.split("\n\n") if line.startswith("data: {")
        ]

    async with running_worker(small_settings(model="sim")) as w:
        body = {"messages": MESSAGES, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}  # fmt: skip
        chat = await events(w, "/v1/chat/completions", body)
        prompt = chat[0]["prompt_token_ids"]
        assert isinstance(prompt, list) and prompt
        assert sum("prompt_token_ids" in e for e in chat) == 1
        ids = [t for e in chat for c in e["choices"] for t in c.get("token_ids") or []]  # type: ignore[union-attr]
        assert len(ids) == 10
        text = "".join(c["delta"].get("content") or "" for e in chat for c in e["choices"])  # type: ignore[union-attr]
        cont = {**body, "max_tokens": 6, "messages": [{"role": "user", "content": "ignored"}],
                "kv_transfer_params": {"prompt_token_ids": [*prompt, *ids[:4]]}}  # fmt: skip
        rest = await events(w, "/v1/chat/completions", cont)
        rest_text = "".join(c["delta"].get("content") or "" for e in rest for c in e["choices"])  # type: ignore[union-attr]
        assert text[: len(text) - len(rest_text)] + rest_text == text and len(rest_text) > 0
        done = [t for e in rest for c in e["choices"] for t in c.get("token_ids") or []]  # type: ignore[union-attr]
        assert ids[:4] + done == ids
        completion = await events(
            w, "/v1/completions", {"prompt": "abc", "max_tokens": 3, "return_token_ids": True}
        )
        firsts = [c.get("prompt_token_ids") for e in completion for c in e["choices"]]  # type: ignore[union-attr]
        assert firsts[0] == list(b"abc") and not any(firsts[1:])
        bad = {**cont, "kv_transfer_params": {"prompt_token_ids": ["x"]}}
        resp = await w.client.post("/v1/chat/completions", json=bad)
        assert resp.status_code == 400
