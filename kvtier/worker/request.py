"""A request inside the engine: tokens, pages, sampling state and its output channel."""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import torch

from kvtier.keys import BlockHash, PromptHashes
from kvtier.worker.sampling import SamplingParams
from kvtier.worker.stop_check import StopStringMatcher
from kvtier.worker.tokenizer import IncrementalDetokenizer


class RequestState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    LENGTH = "length"
    STOP = "stop"
    ABORT = "abort"
    ERROR = "error"


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What a request produced in one step (``finish`` set on its last output)."""

    token_ids: tuple[int, ...]
    text: str
    finish: FinishReason | None = None
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None


@dataclass(frozen=True, slots=True)
class PromptKV:
    """A finished request's prompt KV, handed to a hook before its pages are released."""

    request_id: str
    num_prompt_tokens: int
    block_hashes: tuple[BlockHash, ...]
    page_tables: tuple[tuple[int, ...], ...]


PromptKVHook = Callable[[PromptKV], Awaitable[None]]


@dataclass(eq=False)
class EngineRequest:
    """Mutable per-request state, touched only by the engine loop."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    hashes: PromptHashes
    num_groups: int
    on_prompt_kv: PromptKVHook | None = None
    lora_key: bytes = b""
    """The LoRA adapter it runs under (empty: the base model)."""
    expected_remote_blocks: int = 0
    """Consumer legs: leading blocks the producer was expected to supply (0 otherwise)."""
    output_ids: list[int] = field(default_factory=list)
    state: RequestState = RequestState.WAITING
    num_computed: int = 0
    num_cached_tokens: int = 0
    page_tables: list[list[int]] = field(default_factory=list)
    reserved: list[int] = field(default_factory=list)
    pinned: list[tuple[int, int]] = field(default_factory=list)
    """(group, page) references held for the request before admission (installed remote blocks)."""
    abort_requested: bool = False
    outputs: asyncio.Queue[StepOutput] = field(default_factory=asyncio.Queue)
    generator: torch.Generator | None = None
    detok: IncrementalDetokenizer = field(default_factory=IncrementalDetokenizer)
    stop_matcher: StopStringMatcher | None = None
    arrived_s: float = field(default_factory=time.monotonic)
    """Monotonic time the engine received the request (latency histograms start here)."""
    first_token_s: float | None = None
    last_token_s: float | None = None

    def __post_init__(self) -> None:
        if not self.page_tables:
            self.page_tables = [[] for _ in range(self.num_groups)]
            self.reserved = [0] * self.num_groups
        if self.stop_matcher is None:
            self.stop_matcher = StopStringMatcher(self.params.stop)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def prompt_done(self) -> bool:
        return self.num_computed >= len(self.prompt_ids)
