"""Load-test workloads shared by the Locust file and the benchmark client.

A workload is a finite, seeded sequence of *sessions*. A session yields OpenAI requests one at
a time and is told each answer, so a multi-turn conversation can grow with the model's replies:

- ``random``: fixed-length random prompts, one request per session;
- ``shared-prefix``: ``groups`` system prompts of ``system_prompt_len`` tokens, each followed by
  ``prompts_per_group`` different questions of ``question_len`` tokens (shuffled, so the router
  has to find the group's prefix);
- ``multi-turn``: ``conversations`` chats of ``turns`` turns; each turn sends the whole history
  (system prompt, earlier questions and the model's answers) plus a new question.

Lengths are in tokens of the reference worker's byte tokenizer (one character each); set
``chars_per_token`` (about 4 for English BPE tokenizers) when targeting a real model.
"""

from __future__ import annotations

import argparse
import random
import string
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol


class Endpoint(StrEnum):
    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"


class WorkloadKind(StrEnum):
    RANDOM = "random"
    SHARED_PREFIX = "shared-prefix"
    MULTI_TURN = "multi-turn"


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request to send: path, JSON body and what the workload expects of it."""

    endpoint: Endpoint
    body: Mapping[str, Any]
    prompt_len: int
    """Prompt length the workload asked for, in tokens (before any chat template)."""
    output_len: int
    tag: str
    """Where the request comes from, e.g. ``group-3/q-7`` or ``conv-2/turn-1``."""

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream", False))


class Session(Protocol):
    def next_request(self) -> RequestSpec | None:
        """The next request, or None when the session is over."""
        ...

    def record_answer(self, text: str) -> None:
        """The generated text of the request last returned by :meth:`next_request`."""
        ...


@dataclass(frozen=True, slots=True)
class RequestOptions:
    """How every request of a workload is shaped."""

    model: str = "tiny"
    endpoint: Endpoint = Endpoint.COMPLETIONS
    stream: bool = True
    output_len: int = 16
    temperature: float = 0.0
    ignore_eos: bool = False
    chars_per_token: int = 1
    seed: int = 0


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    kind: WorkloadKind = WorkloadKind.RANDOM
    num_prompts: int = 32
    input_len: int = 128
    groups: int = 4
    prompts_per_group: int = 8
    system_prompt_len: int = 256
    question_len: int = 32
    conversations: int = 4
    turns: int = 4
    options: RequestOptions = field(default_factory=RequestOptions)


class SingleRequest:
    """A session of exactly one request."""

    __slots__ = ("_spec",)

    def __init__(self, spec: RequestSpec) -> None:
        self._spec: RequestSpec | None = spec

    def next_request(self) -> RequestSpec | None:
        spec, self._spec = self._spec, None
        return spec

    def record_answer(self, text: str) -> None:
        """A single request keeps no history."""


class Conversation:
    """A chat that grows: every turn resends the history plus a new question."""

    __slots__ = ("_history", "_name", "_options", "_pending", "_prompt_len", "_questions")

    def __init__(self, name: str, system: str, questions: list[str], options: RequestOptions):
        self._name = name
        self._options = options
        self._history: list[dict[str, str]] = [{"role": "system", "content": system}]
        self._prompt_len = len(system) // options.chars_per_token
        self._questions = list(reversed(questions))
        self._pending = False

    def next_request(self) -> RequestSpec | None:
        if not self._questions:
            return None
        if self._pending:
            # The previous answer never came (the request failed): keep the history consistent.
            self._history.append({"role": "assistant", "content": ""})
        question = self._questions.pop()
        turn = (len(self._history) - 1) // 2
        self._history.append({"role": "user", "content": question})
        self._prompt_len += len(question) // self._options.chars_per_token
        self._pending = True
        messages = [dict(m) for m in self._history]
        return RequestSpec(
            endpoint=Endpoint.CHAT,
            body=_body(self._options, Endpoint.CHAT, messages),
            prompt_len=self._prompt_len,
            output_len=self._options.output_len,
            tag=f"{self._name}/turn-{turn}",
        )

    def record_answer(self, text: str) -> None:
        if self._pending:
            self._history.append({"role": "assistant", "content": text})
            self._prompt_len += len(text) // self._options.chars_per_token
            self._pending = False


def random_text(rng: random.Random, n_chars: int) -> str:
    """``n_chars`` characters of random lowercase words separated by single spaces."""
    parts: list[str] = []
    joined = -1  # length of " ".join(parts)
    letters = string.ascii_lowercase
    while joined < n_chars:
        word = "".join(rng.choices(letters, k=rng.randint(2, 8)))
        parts.append(word)
        joined += len(word) + 1
    return " ".join(parts)[:n_chars]


def _body(options: RequestOptions, endpoint: Endpoint, content: object) -> dict[str, Any]:
    body: dict[str, Any] = {"model": options.model}
    if endpoint is Endpoint.CHAT:
        body["messages"] = content
    else:
        body["prompt"] = content
    body["max_tokens"] = options.output_len
    body["temperature"] = options.temperature
    body["stream"] = options.stream
    if options.stream:
        body["stream_options"] = {"include_usage": True}
    if options.ignore_eos:
        body["ignore_eos"] = True
    return body


def _single(options: RequestOptions, system: str, question: str, tag: str) -> RequestSpec:
    if options.endpoint is Endpoint.CHAT:
        messages = [{"role": "user", "content": question}]
        if system:
            messages.insert(0, {"role": "system", "content": system})
        body = _body(options, Endpoint.CHAT, messages)
    else:
        body = _body(options, Endpoint.COMPLETIONS, system + question)
    return RequestSpec(
        endpoint=options.endpoint,
        body=body,
        prompt_len=(len(system) + len(question)) // options.chars_per_token,
        output_len=options.output_len,
        tag=tag,
    )


def sessions(config: WorkloadConfig) -> Iterator[Session]:
    """The workload's sessions in sending order (deterministic for a given seed)."""
    options = config.options
    rng = random.Random(options.seed)
    cpt = options.chars_per_token
    if config.kind is WorkloadKind.RANDOM:
        for i in range(config.num_prompts):
            text = random_text(rng, config.input_len * cpt)
            yield SingleRequest(_single(options, "", text, f"prompt-{i}"))
    elif config.kind is WorkloadKind.SHARED_PREFIX:
        systems = [random_text(rng, config.system_prompt_len * cpt) for _ in range(config.groups)]
        pairs = [(g, q) for g in range(config.groups) for q in range(config.prompts_per_group)]
        questions = {pair: random_text(rng, config.question_len * cpt) for pair in pairs}
        rng.shuffle(pairs)
        for g, q in pairs:
            # The separator ends the shared prefix; questions start after it.
            spec = _single(options, systems[g] + "\n", questions[(g, q)], f"group-{g}/q-{q}")
            yield SingleRequest(spec)
    else:
        for c in range(config.conversations):
            system = random_text(rng, config.system_prompt_len * cpt)
            asks = [random_text(rng, config.question_len * cpt) for _ in range(config.turns)]
            yield Conversation(f"conv-{c}", system, asks, options)


def total_requests(config: WorkloadConfig) -> int:
    if config.kind is WorkloadKind.RANDOM:
        return config.num_prompts
    if config.kind is WorkloadKind.SHARED_PREFIX:
        return config.groups * config.prompts_per_group
    return config.conversations * config.turns


def add_workload_arguments(parser: Any, env_prefix: str | None = None) -> None:
    """Add the workload flags to an argparse (or Locust/configargparse) parser.

    With ``env_prefix`` (Locust: ``"LOCUST_"``) each flag can also be set from the environment,
    e.g. ``LOCUST_WORKLOAD=shared-prefix``.
    """
    defaults = WorkloadConfig()
    opts = RequestOptions()

    def add(flag: str, **kwargs: Any) -> None:
        if env_prefix is not None:
            kwargs["env_var"] = env_prefix + flag.lstrip("-").replace("-", "_").upper()
        parser.add_argument(flag, **kwargs)

    add("--workload", choices=[k.value for k in WorkloadKind], default=defaults.kind.value)
    add("--model", default="", help="model in each request (default: the server's first)")
    add("--endpoint", choices=["completions", "chat"], default="completions")
    add("--no-stream", action="store_true", help="send non-streaming requests")
    add("--output-len", type=int, default=opts.output_len, help="max_tokens per request")
    add("--ignore-eos", action="store_true", help="ask the engine to ignore EOS")
    add("--chars-per-token", type=int, default=opts.chars_per_token)
    add("--seed", type=int, default=opts.seed)
    add("--num-prompts", type=int, default=defaults.num_prompts, help="random: prompt count")
    add("--input-len", type=int, default=defaults.input_len, help="random: prompt length")
    add("--groups", type=int, default=defaults.groups, help="shared-prefix: groups")
    add("--prompts-per-group", type=int, default=defaults.prompts_per_group)
    add("--system-prompt-len", type=int, default=defaults.system_prompt_len)
    add("--question-len", type=int, default=defaults.question_len)
    add("--conversations", type=int, default=defaults.conversations, help="multi-turn: chats")
    add("--turns", type=int, default=defaults.turns, help="multi-turn: turns per chat")


def config_from_arguments(ns: argparse.Namespace) -> WorkloadConfig:
    kind = WorkloadKind(ns.workload)
    endpoint = Endpoint.CHAT if ns.endpoint == "chat" else Endpoint.COMPLETIONS
    if kind is WorkloadKind.MULTI_TURN:
        endpoint = Endpoint.CHAT
    options = RequestOptions(
        model=ns.model,
        endpoint=endpoint,
        stream=not ns.no_stream,
        output_len=ns.output_len,
        ignore_eos=ns.ignore_eos,
        chars_per_token=max(1, ns.chars_per_token),
        seed=ns.seed,
    )
    return WorkloadConfig(
        kind=kind,
        num_prompts=ns.num_prompts,
        input_len=ns.input_len,
        groups=ns.groups,
        prompts_per_group=ns.prompts_per_group,
        system_prompt_len=ns.system_prompt_len,
        question_len=ns.question_len,
        conversations=ns.conversations,
        turns=ns.turns,
        options=options,
    )
