"""Reading the prompt out of OpenAI bodies: what can be hashed and what routes by load."""

from __future__ import annotations

import pytest

from pdproxy.tokenize.prompt import (
    ChatPrompt,
    TextPrompt,
    TokenPrompt,
    Unhashable,
    cache_salt_of,
    prompt_of,
)


def test_completion_text_and_token_prompts() -> None:
    assert prompt_of("completions", {"prompt": "hi"}) == TextPrompt("hi", True)
    assert prompt_of("completions", {"prompt": ["hi"]}) == TextPrompt("hi", True)
    assert prompt_of("completions", {"prompt": "hi", "add_special_tokens": False}) == TextPrompt(
        "hi", False
    )
    assert prompt_of("completions", {"prompt": [1, 2, 3]}) == TokenPrompt([1, 2, 3])
    assert prompt_of("completions", {"prompt": [[4, 5]]}) == TokenPrompt([4, 5])
    # Token ids are validated when hashed (in C), not here: see the router's invalid-tokens test.
    assert prompt_of("completions", {"prompt": [1, -2]}) == TokenPrompt([1, -2])


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({"prompt": ["a", "b"]}, "batch"),
        ({"prompt": [[1], [2]]}, "batch"),
        ({"prompt": []}, "empty-prompt"),
        ({"prompt": [[1, 2], "x"]}, "batch"),
        ({"prompt": [{"a": 1}]}, "invalid-prompt"),
        ({"prompt": None}, "invalid-prompt"),
        ({"prompt": "x", "prompt_embeds": "AAAA"}, "prompt-embeds"),
    ],
)
def test_completion_prompts_that_cannot_be_hashed(body: dict[str, object], reason: str) -> None:
    assert prompt_of("completions", body) == Unhashable(reason)


def test_chat_text_parts_are_joined_and_extras_kept() -> None:
    body = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {"role": "assistant", "content": None, "tool_calls": [{"id": "t"}]},
        ],
        "add_generation_prompt": False,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    prompt = prompt_of("chat", body)
    assert isinstance(prompt, ChatPrompt)
    assert [m.content for m in prompt.messages] == ["be brief", "a\nb", ""]
    assert prompt.messages[2].as_template_dict() == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "t"}],
    }
    assert prompt.add_generation_prompt is False
    assert dict(prompt.template_kwargs) == {"enable_thinking": False}


@pytest.mark.parametrize(
    ("messages", "reason"),
    [
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "multimodal",
        ),
        ([{"role": "user", "content": [{"type": "input_audio"}]}], "multimodal"),
        ([{"content": "no role"}], "invalid-messages"),
        ([], "invalid-messages"),
        ("not a list", "invalid-messages"),
        ([{"role": "user", "content": 7}], "invalid-messages"),
    ],
)
def test_chat_requests_that_cannot_be_hashed(messages: object, reason: str) -> None:
    assert prompt_of("chat", {"messages": messages}) == Unhashable(reason)


def test_cache_salt_and_unknown_endpoint() -> None:
    assert cache_salt_of({"cache_salt": "tenant-a"}) == "tenant-a"
    assert cache_salt_of({"cache_salt": ""}) is None
    assert cache_salt_of({}) is None
    assert prompt_of("embeddings", {"input": "x"}) == Unhashable("endpoint-embeddings")
