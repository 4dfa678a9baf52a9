"""How a backend pool's prompts are turned into token ids."""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field


class TokenizerKind(StrEnum):
    BYTES = "bytes"
    """UTF-8 bytes as token ids: the reference worker's tokenizer."""
    HF = "hf"
    """A local Hugging Face ``tokenizer.json`` (chat template from ``tokenizer_config.json``)."""
    BACKEND = "backend"
    """The backend's own ``POST /tokenize`` endpoint."""


class TokenizerSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: TokenizerKind = TokenizerKind.BYTES
    path: str | None = Field(
        default=None, description="hf: directory holding tokenizer.json and tokenizer_config.json"
    )
    url: str | None = Field(default=None, description="backend: base URL whose /tokenize is called")
    model: str | None = Field(default=None, description="backend: model name sent to /tokenize")
    timeout_s: float = Field(
        default=0.5, gt=0.0, description="backend: bound on one /tokenize call"
    )
    offload_threshold_chars: int = Field(
        default=16_384,
        ge=0,
        description="prompts longer than this are tokenized off the event loop",
    )
