"""Local tokenizers: the worker's byte tokenizer, a Hugging Face tokenizer.json with its chat
template, and the off-loop rule for long prompts."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from kvtier.worker.tokenizer import ByteTokenizer
from pdproxy.settings.routing import TokenizerKind, TokenizerSettings
from pdproxy.tokenize.base import OffLoopTokenizer, token_ids
from pdproxy.tokenize.build import build_tokenizer
from pdproxy.tokenize.byte_level import ByteEncoder
from pdproxy.tokenize.errors import TokenizationError, TokenizerUnavailable
from pdproxy.tokenize.prompt import (
    ChatMessage,
    ChatPrompt,
    TextPrompt,
    TokenPrompt,
    prompt_chars,
    prompt_of,
)

LLAMA3_LIKE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "<|start|>{{ message['role'] }}\n{{ message['content'] | trim }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|start|>assistant\n{% endif %}"
)


def chat(body: dict[str, object]) -> ChatPrompt:
    prompt = prompt_of("chat", body)
    assert isinstance(prompt, ChatPrompt)
    return prompt


@pytest.mark.parametrize(
    "messages",
    [
        [("user", "hello")],
        [("system", "Sé breve ✓"), ("user", "2+2?"), ("assistant", "4"), ("user", "and 3+3")],
        [("user", "")],
    ],
)
def test_byte_encoder_matches_the_reference_worker(messages: list[tuple[str, str]]) -> None:
    worker = ByteTokenizer()
    body = {"messages": [{"role": r, "content": c} for r, c in messages]}
    expected = worker.encode(worker.apply_chat_template(messages))
    assert ByteEncoder().encode(chat(body)) == expected
    text = "".join(c for _, c in messages)
    assert ByteEncoder().encode(TextPrompt(text)) == worker.encode(text)


def test_byte_encoder_joins_text_parts_as_the_worker_does() -> None:
    from kvtier.worker.server.protocol import ChatMessage as WorkerMessage

    raw = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None},
    ]
    worker = ByteTokenizer()
    rendered = worker.apply_chat_template(
        [(m.role, m.text()) for m in (WorkerMessage.model_validate(x) for x in raw)]
    )
    assert ByteEncoder().encode(chat({"messages": raw})) == worker.encode(rendered)


@pytest.fixture
def hf_dir(tmp_path: Path) -> Path:
    words = ["<s>", "</s>", "<|start|>", "<|end|>", "[UNK]", "hello", "world", "user", "system"]
    words += ["assistant", "be", "brief", "\n"]
    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.add_special_tokens(["<s>", "</s>", "<|start|>", "<|end|>"])
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit()])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", vocab["<s>"])]
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    config = {
        "bos_token": {"content": "<s>", "lstrip": False},
        "eos_token": "</s>",
        "chat_template": [
            {"name": "default", "template": LLAMA3_LIKE},
            {"name": "tool_use", "template": "{{ bos_token }}tools {{ tools | tojson }}"},
        ],
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


async def test_hf_text_prompt_adds_special_tokens_like_the_engine(hf_dir: Path) -> None:
    tok = build_tokenizer(TokenizerSettings(kind=TokenizerKind.HF, path=str(hf_dir)))
    hf = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    bos = hf.token_to_id("<s>")
    assert list(await tok.tokenize(TextPrompt("hello world"))) == [bos, 5, 6]
    assert list(await tok.tokenize(TextPrompt("hello world", add_special_tokens=False))) == [5, 6]


async def test_hf_chat_renders_the_template_and_adds_no_second_bos(hf_dir: Path) -> None:
    tok = build_tokenizer(TokenizerSettings(kind=TokenizerKind.HF, path=str(hf_dir)))
    hf = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    body = {
        "messages": [
            {"role": "system", "content": " be brief "},
            {"role": "user", "content": "hello"},
        ]
    }
    ids = list(await tok.tokenize(chat(body)))
    rendered = "<s><|start|>system\nbe brief<|end|><|start|>user\nhello<|end|><|start|>assistant\n"
    assert ids == hf.encode(rendered, add_special_tokens=False).ids
    assert ids.count(hf.token_to_id("<s>")) == 1
    no_gen = list(await tok.tokenize(chat({**body, "add_generation_prompt": False})))
    assert no_gen == ids[: len(no_gen)] and len(no_gen) < len(ids)


async def test_hf_tool_template_and_template_errors(hf_dir: Path) -> None:
    tok = build_tokenizer(TokenizerSettings(kind=TokenizerKind.HF, path=str(hf_dir)))
    hf = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    body = {"messages": [{"role": "user", "content": "hello"}], "tools": [{"name": "é"}]}
    ids = list(await tok.tokenize(chat(body)))
    assert ids == hf.encode('<s>tools [{"name": "é"}]', add_special_tokens=False).ids
    with pytest.raises(TokenizationError, match="unknown role"):
        await tok.tokenize(chat({"messages": [{"role": "tool", "content": "x"}]}))


def test_hf_missing_files_are_typed_errors(tmp_path: Path) -> None:
    with pytest.raises(TokenizerUnavailable):
        build_tokenizer(TokenizerSettings(kind=TokenizerKind.HF, path=str(tmp_path)))


async def test_hf_without_template_refuses_chat(hf_dir: Path) -> None:
    (hf_dir / "tokenizer_config.json").write_text("{}")
    tok = build_tokenizer(TokenizerSettings(kind=TokenizerKind.HF, path=str(hf_dir)))
    with pytest.raises(TokenizationError, match="no chat template"):
        await tok.tokenize(chat({"messages": [{"role": "user", "content": "hello"}]}))


class ThreadRecordingEncoder:
    def __init__(self) -> None:
        self.threads: list[int] = []

    def encode(self, prompt: TextPrompt | ChatPrompt) -> list[int]:
        self.threads.append(threading.get_ident())
        return ByteEncoder().encode(prompt)


async def test_long_prompts_are_tokenized_off_the_event_loop() -> None:
    encoder = ThreadRecordingEncoder()
    tok = OffLoopTokenizer(encoder, threshold_chars=100)
    loop_thread = threading.get_ident()
    assert list(await tok.tokenize(TextPrompt("a" * 100))) == [97] * 100
    assert list(await tok.tokenize(TextPrompt("a" * 101))) == [97] * 101
    assert encoder.threads[0] == loop_thread
    assert encoder.threads[1] != loop_thread
    await tok.close()


async def test_off_loop_size_counts_everything_the_template_renders() -> None:
    """A chat prompt with short messages but huge tools, template kwargs or roles is big."""
    encoder = ThreadRecordingEncoder()
    tok = OffLoopTokenizer(encoder, threshold_chars=1000)
    loop_thread = threading.get_ident()
    small = ChatMessage("user", "hi")
    huge_tools = ({"type": "function", "function": {"description": "d" * 5000}},)
    deep_kwargs = (("ctx", [[["k" * 400] * 3]]),)
    for prompt in (
        ChatPrompt((small,)),
        ChatPrompt((small,), tools=huge_tools),
        ChatPrompt((small,), template_kwargs=deep_kwargs),
        ChatPrompt((ChatMessage("r" * 2000, "hi"),)),
        ChatPrompt((ChatMessage("user", "hi", extra=(("name", "n" * 2000),)),)),
    ):
        await tok.tokenize(prompt)
    assert encoder.threads[0] == loop_thread
    assert all(t != loop_thread for t in encoder.threads[1:])
    # The measure stops early: a prompt with 200k tiny tool entries costs a bounded walk.
    wide = ChatPrompt((small,), tools=tuple({"a": i} for i in range(200_000)))
    assert 1000 < prompt_chars(wide, 1000) < 1100


async def test_token_prompts_skip_tokenization() -> None:
    encoder = ThreadRecordingEncoder()
    tok = OffLoopTokenizer(encoder, threshold_chars=0)
    assert await token_ids(tok, TokenPrompt((5, 6, 7))) == (5, 6, 7)
    assert encoder.threads == []


async def test_lone_surrogates_are_a_typed_error(hf_dir: Path) -> None:
    bad = TextPrompt("ok \ud800 not ok")
    with pytest.raises(TokenizationError):
        ByteEncoder().encode(bad)
    tok = build_tokenizer(TokenizerSettings(kind=TokenizerKind.HF, path=str(hf_dir)))
    with pytest.raises(TokenizationError):
        await tok.tokenize(bad)
