"""Request bodies of the OpenAI endpoints the worker serves (unknown fields are tolerated)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from kvtier.worker.kv_params import MAX_ID_CHARS


def _encodable(value: str | None) -> str | None:
    """Text the worker hashes or echoes must be valid Unicode (no lone surrogates)."""
    if value is not None:
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError("text is not valid Unicode (lone surrogate)") from exc
    return value


UnicodeText = Annotated[str | None, AfterValidator(_encodable)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = -1
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    """The range torch generators accept (a 64-bit seed, signed or not)."""
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=1)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    kv_transfer_params: dict[str, Any] | None = None
    cache_salt: UnicodeText = None
    return_token_ids: bool = False
    """vLLM extension: each choice carries the generated token ids (``token_ids``)."""

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    min_completion_tokens: int = Field(default=0, ge=0)
    logprobs: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    """vLLM's extension: generation continues the final (assistant) message."""


class ReleaseRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    kv_request_id: str = Field(min_length=1, max_length=MAX_ID_CHARS)


class LoadLoraRequest(BaseModel):
    """vLLM's ``POST /v1/load_lora_adapter`` body."""

    model_config = ConfigDict(extra="allow")

    lora_name: str = Field(min_length=1, max_length=128)
    lora_path: str = Field(default="", max_length=4096)


class UnloadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    lora_name: str = Field(min_length=1, max_length=128)
