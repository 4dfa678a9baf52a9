"""LoRA adapters of the reference worker, served as model names the way vLLM serves them.

vLLM (``--enable-lora``) serves each adapter under its own model name: ``--lora-modules
name=path`` at start, ``POST /v1/load_lora_adapter {"lora_name", "lora_path"}`` and
``/v1/unload_lora_adapter {"lora_name"}`` at run time, and ``/v1/models`` lists each adapter
with its base model as ``parent``. The reference worker does the same with synthetic adapters:
an adapter's effect is a deterministic function of its name (``sim``: the name enters every
output token's digest; ``tiny``: a seeded rank-4 delta on the output head), so each adapter's
text differs from the base model's and from every other adapter's, and ``lora_path`` is only
echoed. Blocks computed under an adapter are hashed with its name in every block's extra
(:func:`kvtier.keys.lora_extra`), so the prefix cache never hands a base-model block to an
adapter request, and their KV events carry ``lora_id``/``lora_name`` as vLLM's do.

Loading is behind the worker's API key like every route; at most ``max_loras`` adapters are
loaded at once (400 beyond).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import xxhash

from kvtier.worker.errors import InvalidRequest

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    name: str
    lora_id: int
    """vLLM's integer id of a loaded adapter (1-based; 0 is the base model)."""
    path: str

    @property
    def key(self) -> bytes:
        """16 bytes naming the adapter inside the compute backends."""
        return xxhash.xxh3_128_digest(b"kvtier/lora/v1\x00" + self.name.encode())


def check_adapter_name(name: str) -> str:
    if not _NAME.match(name):
        raise InvalidRequest(
            "lora_name must be 1-128 characters of letters, digits and ._:/-", "lora_name"
        )
    return name


class LoraAdapters:
    """The adapters loaded now (the engine loop and the HTTP handlers share one event loop)."""

    def __init__(self, base_model: str, max_loras: int) -> None:
        self._base = base_model
        self._max = max_loras
        self._loaded: dict[str, LoraAdapter] = {}
        self._next_id = 1

    def load(self, name: str, path: str = "") -> LoraAdapter:
        check_adapter_name(name)
        if name == self._base:
            raise InvalidRequest(f"`{name}` is the base model's name", "lora_name")
        if name in self._loaded:
            raise InvalidRequest(f"The lora adapter '{name}' has already been loaded.", "lora_name")
        if len(self._loaded) >= self._max:
            raise InvalidRequest(f"at most {self._max} LoRA adapters can be loaded", "lora_name")
        adapter = LoraAdapter(name, self._next_id, path or name)
        self._next_id += 1
        self._loaded[name] = adapter
        return adapter

    def unload(self, name: str) -> None:
        if self._loaded.pop(name, None) is None:
            raise InvalidRequest(f"The lora adapter '{name}' cannot be found.", "lora_name")

    def get(self, name: str) -> LoraAdapter | None:
        return self._loaded.get(name)

    def all(self) -> list[LoraAdapter]:
        return list(self._loaded.values())
