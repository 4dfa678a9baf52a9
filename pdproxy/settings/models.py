"""Settings of many models behind one proxy (``models:`` in the proxy config).

Which backend serves which model is said per backend (``backends[].models``) or learned from
each backend's ``GET /v1/models`` on every health check. This section adds what only the proxy
knows: per-model KV router options (hash seed, block size, tokenizer), LoRA adapters' base
models, and per-model admission limits. Nothing here reads the environment.
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pdproxy.settings.routing import KvRouterSettings

MODEL_NAME_MAX = 256
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def check_model_name(value: str) -> str:
    """A model name as engines accept it: non-empty, bounded, no control characters."""
    if not value or len(value) > MODEL_NAME_MAX or _CONTROL.search(value):
        raise ValueError(
            f"model names must be 1-{MODEL_NAME_MAX} characters without control characters"
        )
    return value


class ModelLimits(BaseModel):
    """Admission for one model, taken after the proxy-wide slot (once the body says the model).

    A request queued here keeps its proxy-wide slot, so a model may hold at most
    ``max_concurrent + queue_size`` of them: that sum must stay below
    ``admission.max_concurrent`` (checked at start), which is what keeps one hot model from
    starving the others."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_concurrent: int = Field(ge=1)
    queue_size: int = Field(default=0, ge=0)
    queue_timeout_s: float = Field(default=10.0, gt=0)


class ModelConfig(BaseModel):
    """One model (or LoRA adapter) the operator names."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    router_options: KvRouterSettings = Field(default_factory=KvRouterSettings)
    """Over the top-level ``router_options`` for this model's KV router: only the keys set here
    count (:meth:`~pdproxy.settings.routing.KvRouterSettings.over`): ``model_seed``,
    ``block_size``, ``tokenizer``... (``events``/``replay`` stay top-level, per backend)."""
    base: str | None = None
    """For a LoRA adapter: its base model. Learned from ``/v1/models`` (vLLM's ``parent``)
    when unset."""
    load_on_demand: bool = False
    """Adapter only: when no routable backend has it loaded, send it to backends serving the
    base model (engines with a LoRA resolver load adapters on first use)."""
    limits: ModelLimits | None = None
    """Over ``models.default_limits`` for this model."""

    @field_validator("base")
    @classmethod
    def _check_base(cls, value: str | None) -> str | None:
        return None if value is None else check_model_name(value)


class ModelsSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    served: dict[str, ModelConfig] = Field(default_factory=dict)
    """Model name -> what the proxy should know about it (all optional)."""
    learn: bool = True
    """Learn each backend's models (and loaded LoRA adapters) from its ``/v1/models`` on every
    health check; a backend whose list is not known yet (or cannot be read) serves any model."""
    max_learned: int = Field(default=256, ge=1)
    """Most distinct model names known beyond the configured ones (learned from ``/v1/models``,
    announced by registered workers, on admin-added backends): bounds metric labels, per-model
    routers and admission buckets. A name no backend lists any more is forgotten."""
    max_learned_per_backend: int = Field(default=64, ge=1)
    """Most of those names one backend may bring: one backend listing junk cannot take the
    whole ``max_learned`` budget from the others."""
    max_list_bytes: int = Field(default=1024 * 1024, ge=1024)
    """A backend's ``/v1/models`` answer larger than this is not parsed (the backend keeps the
    list it had). 1 MiB is about 2,000 vLLM entries."""
    default_limits: ModelLimits | None = None
    """Per-model admission for every model without limits of its own (None: none)."""

    @field_validator("served")
    @classmethod
    def _check_names(cls, value: dict[str, ModelConfig]) -> dict[str, ModelConfig]:
        for name in value:
            check_model_name(name)
        return value

    @model_validator(mode="after")
    def _bases_are_not_adapters(self) -> ModelsSettings:
        for name, config in self.served.items():
            if config.base == name:
                raise ValueError(f"model {name!r} names itself as its base")
            base = self.served.get(config.base) if config.base else None
            if base is not None and base.base is not None:
                raise ValueError(f"adapter {name!r}: its base {config.base!r} is an adapter")
            if config.load_on_demand and config.base is None:
                raise ValueError(f"model {name!r}: load_on_demand needs a base model")
        return self

    def limits_of(self, model: str) -> ModelLimits | None:
        config = self.served.get(model)
        if config is not None and config.limits is not None:
            return config.limits
        return self.default_limits
