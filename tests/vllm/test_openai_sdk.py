"""The official ``openai`` SDK through pdproxy in front of a real vLLM PD pair."""

from __future__ import annotations

import openai
import pytest

from tests.vllm.conftest import MODEL, VllmStack

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

PROMPT = "The quick brown fox jumps over the lazy dog. " * 8
GREEDY = {"ignore_eos": True}
"""vLLM's extra sampling field: a random model may emit EOS at any step; the counts below need
every requested token."""


@pytest.fixture
def client(vllm_stack: VllmStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=vllm_stack.pd_url + "/v1", api_key="unused", timeout=120.0)


def test_completions_not_streamed(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, extra_body=GREEDY
    )
    assert out.model == MODEL
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 6
    assert out.usage.prompt_tokens > 64


def test_completions_streamed_with_usage(client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=GREEDY,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1 and usage[0].completion_tokens == 6
    assert chunks[-1].usage is not None and not chunks[-1].choices
    whole = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, extra_body=GREEDY
    )
    assert text == whole.choices[0].text  # greedy: streamed and whole agree


def test_chat_not_streamed(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "You are a terse assistant. " * 10},
            {"role": "user", "content": "Name three rivers."},
        ],
        max_tokens=5,
        temperature=0,
        extra_body=GREEDY,
    )
    assert out.choices[0].message.role == "assistant"
    assert out.usage is not None and out.usage.completion_tokens == 5


def test_chat_streamed_with_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me a story about a garden. " * 6}],
        max_tokens=5,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=GREEDY,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    finished = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finished[-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5


def test_vllm_errors_reach_the_client_as_vllm_sent_them(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=2)
    assert "no-such-model" in str(missing.value.message)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=-1)
