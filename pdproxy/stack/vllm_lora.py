"""A LoRA adapter for the tiny local model, written from a seed like the model itself.

``pdproxy up --engine vllm --lora NAME`` serves one per name (``--enable-lora --lora-modules
NAME=PATH``); the system tests do too. The adapter is PEFT's on-disk format, which vLLM loads:
``adapter_config.json`` and ``adapter_model.safetensors`` with ``lora_A``/``lora_B`` for every
attention and MLP projection of every layer. Pure Python (no torch, no peft): the same name and
seed give the same bytes on any machine.

The update is as large as the weights it adapts (``lora_alpha == r``, both factors random): the
adapter's greedy answers differ from the base model's, so a test can tell which one served.

    python -m pdproxy.stack.vllm_lora --out DIR --name NAME [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import math
import random
from collections.abc import Iterator, Sequence
from pathlib import Path

from pdproxy.stack.vllm_engine import LORA_MAX_RANK
from pdproxy.stack.vllm_model import (
    Tensor,
    TinyLlamaShape,
    bf16,
    replacing_directory,
    write_safetensors,
)

LORA_RANK = LORA_MAX_RANK
"""The adapters' rank: what the instances that load them are started with."""

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _projections(shape: TinyLlamaShape) -> dict[str, tuple[str, int, int]]:
    """Module → (parent, in features, out features) of the tiny Llama."""
    h, kv, m = shape.hidden, shape.kv_heads * shape.head_dim, shape.intermediate
    return {
        "q_proj": ("self_attn", h, h),
        "k_proj": ("self_attn", h, kv),
        "v_proj": ("self_attn", h, kv),
        "o_proj": ("self_attn", h, h),
        "gate_proj": ("mlp", h, m),
        "up_proj": ("mlp", h, m),
        "down_proj": ("mlp", m, h),
    }


def _tensors(name: str, seed: int, shape: TinyLlamaShape, rank: int) -> Iterator[Tensor]:
    rng = random.Random(f"lora/{name}/{seed}")

    def normal(rows: int, cols: int, std: float) -> bytes:
        return bf16(rng.gauss(0.0, std) for _ in range(rows * cols))

    for layer in range(shape.layers):
        for module, (parent, fan_in, fan_out) in _projections(shape).items():
            prefix = f"base_model.model.model.layers.{layer}.{parent}.{module}"
            # B·A has entries of std ≈ 1/sqrt(fan_in), like the base weights themselves.
            a = normal(rank, fan_in, 1 / math.sqrt(fan_in))
            b = normal(fan_out, rank, 1 / math.sqrt(rank))
            yield f"{prefix}.lora_A.weight", [rank, fan_in], a
            yield f"{prefix}.lora_B.weight", [fan_out, rank], b


def adapter_config(base_model: str, rank: int = LORA_RANK) -> dict[str, object]:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": rank,
        "lora_dropout": 0.0,
        "target_modules": list(TARGET_MODULES),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }


def make_adapter(
    out: Path,
    name: str,
    *,
    seed: int = 0,
    base_model: str = "tiny-llama",
    shape: TinyLlamaShape | None = None,
) -> Path:
    """Write the adapter directory ``out`` (replacing it whole, never half-written)."""
    shape = shape or TinyLlamaShape()
    with replacing_directory(out) as tmp:
        config = json.dumps(adapter_config(base_model), indent=2, sort_keys=True) + "\n"
        (tmp / "adapter_config.json").write_text(config, encoding="utf-8")
        tensors = list(_tensors(name, seed, shape, LORA_RANK))
        write_safetensors(tmp / "adapter_model.safetensors", tensors)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdproxy.stack.vllm_lora", description=__doc__)
    parser.add_argument("--out", type=Path, required=True, help="adapter directory to (re)write")
    parser.add_argument("--name", required=True, help="the adapter's name (seeds its weights)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    make_adapter(args.out, args.name, seed=args.seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
