"""The tiny model real vLLM serves in the local stack and the system tests, made on this machine.

No model can be downloaded here, so a random Llama is written from a seed: ``config.json``,
``model.safetensors`` (bf16), a byte-level BPE ``tokenizer.json`` trained with ``tokenizers`` on a
generated corpus, and ``tokenizer_config.json`` with a chat template. Pure Python plus
``tokenizers`` (no torch, no transformers): the same seed gives the same bytes on any machine.

Shape constraints come from vLLM's CPU attention backend: head_dim >= 32 (hidden 128 / 4 heads),
GQA with 2 KV heads. The output head is scaled so greedy decoding has clear winners: a flat
random head would let bf16 rounding differences between a prefill and a decode instance flip
argmax ties and make "PD output equals single node" a coin toss.

    python -m pdproxy.stack.vllm_model --out DIR [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import struct
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

BOS, EOS, PAD = "<s>", "</s>", "<pad>"

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_CORPUS_WORDS = (
    "the a of and to in is that it for on with as was at by be this from or have an are not "
    "cache block token prefix prefill decode proxy router engine request stream model layer "
    "river mountain window garden paper music light number question answer story morning "
    "quick brown fox jumps over lazy dog red green blue small large early late first last "
    "data memory page transfer node worker event index hash chain batch queue time value"
)


@dataclass(frozen=True, slots=True)
class TinyLlamaShape:
    hidden: int = 128
    intermediate: int = 256
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    vocab_target: int = 512
    max_positions: int = 2048

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def corpus(seed: int, sentences: int = 4000) -> Iterator[str]:
    """Generated English-like sentences with digits and punctuation: enough to learn merges."""
    rng = random.Random(f"corpus/{seed}")
    words_of = _CORPUS_WORDS.split()
    for _ in range(sentences):
        words = [rng.choice(words_of) for _ in range(rng.randint(4, 14))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 9999)))
        yield " ".join(words).capitalize() + rng.choice(".?!,;:")


def train_tokenizer(seed: int, vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(seed), trainer=trainer)
    return tokenizer


def bf16(values: Iterator[float]) -> bytes:
    """Round-to-nearest-even float32 → bfloat16, little endian."""
    out = bytearray()
    for v in values:
        (bits,) = struct.unpack("<I", struct.pack("<f", v))
        bits += 0x7FFF + ((bits >> 16) & 1)
        out += struct.pack("<H", (bits >> 16) & 0xFFFF)
    return bytes(out)


Tensor = tuple[str, list[int], bytes]
"""Name, shape, bf16 bytes."""


def _tensors(shape: TinyLlamaShape, vocab: int, seed: int) -> Iterator[Tensor]:
    rng = random.Random(f"weights/{seed}")

    def normal(rows: int, cols: int, std: float) -> bytes:
        return bf16(rng.gauss(0.0, std) for _ in range(rows * cols))

    def ones(n: int) -> bytes:
        return bf16(1.0 for _ in range(n))

    h, kv = shape.hidden, shape.kv_heads * shape.head_dim
    yield "model.embed_tokens.weight", [vocab, h], normal(vocab, h, 1.0)
    for i in range(shape.layers):
        p = f"model.layers.{i}"
        yield f"{p}.input_layernorm.weight", [h], ones(h)
        yield f"{p}.self_attn.q_proj.weight", [h, h], normal(h, h, 1 / math.sqrt(h))
        yield f"{p}.self_attn.k_proj.weight", [kv, h], normal(kv, h, 1 / math.sqrt(h))
        yield f"{p}.self_attn.v_proj.weight", [kv, h], normal(kv, h, 1 / math.sqrt(h))
        yield f"{p}.self_attn.o_proj.weight", [h, h], normal(h, h, 0.5 / math.sqrt(h))
        yield f"{p}.post_attention_layernorm.weight", [h], ones(h)
        m = shape.intermediate
        yield f"{p}.mlp.gate_proj.weight", [m, h], normal(m, h, 1 / math.sqrt(h))
        yield f"{p}.mlp.up_proj.weight", [m, h], normal(m, h, 1 / math.sqrt(h))
        yield f"{p}.mlp.down_proj.weight", [h, m], normal(h, m, 0.5 / math.sqrt(m))
    yield "model.norm.weight", [h], ones(h)
    # Logit std ≈ 0.4 * sqrt(128) ≈ 4.5: decisive argmax (see the module docstring).
    yield "lm_head.weight", [vocab, h], normal(vocab, h, 0.4)


def write_safetensors(path: Path, tensors: Sequence[Tensor]) -> None:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dims, data in tensors:
        end = offset + len(data)
        header[name] = {"dtype": "BF16", "shape": dims, "data_offsets": [offset, end]}
        offset = end
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format wants the data 8-byte aligned
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, _, data in tensors:
            f.write(data)


def _config(shape: TinyLlamaShape, vocab: int, bos: int, eos: int) -> dict[str, object]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": shape.max_positions,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": vocab,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": "bfloat16",
    }


def _tokenizer_config() -> dict[str, object]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "model_max_length": TinyLlamaShape().max_positions,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def _dump(path: Path, data: object) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def make_model(out: Path, seed: int = 0, shape: TinyLlamaShape | None = None) -> Path:
    """Write the model directory ``out`` (replacing it whole, never half-written)."""
    shape = shape or TinyLlamaShape()
    tokenizer = train_tokenizer(seed, shape.vocab_target)
    vocab = tokenizer.get_vocab_size()
    bos, eos = tokenizer.token_to_id(BOS), tokenizer.token_to_id(EOS)
    if bos is None or eos is None:
        raise RuntimeError("the trained tokenizer lost its special tokens")
    with replacing_directory(out) as tmp:
        tokenizer.save(str(tmp / "tokenizer.json"))
        _dump(tmp / "tokenizer_config.json", _tokenizer_config())
        special = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
        _dump(tmp / "special_tokens_map.json", special)
        _dump(tmp / "config.json", _config(shape, vocab, bos, eos))
        _dump(tmp / "generation_config.json", {"bos_token_id": bos, "eos_token_id": eos})
        write_safetensors(tmp / "model.safetensors", list(_tensors(shape, vocab, seed)))
    return out


@contextmanager
def replacing_directory(out: Path) -> Iterator[Path]:
    """A fresh directory beside ``out`` to fill; it replaces ``out`` whole when the block ends,
    and is removed if the block raises: a reader never sees a half-written model."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; vLLM may run as another user
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdproxy.stack.vllm_model", description=__doc__)
    parser.add_argument("--out", type=Path, required=True, help="model directory to (re)write")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    make_model(args.out, args.seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
