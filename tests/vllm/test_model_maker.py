"""The locally-made tiny model: same seed, same bytes; the shape vLLM's CPU backend needs."""

from __future__ import annotations

import itertools
import json
import struct
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from pdproxy.stack.vllm_model import make_model, replacing_directory


def _files(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())}


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path: Path) -> None:
    a = _files(make_model(tmp_path / "a", seed=0))
    b = _files(make_model(tmp_path / "b", seed=0))
    c = _files(make_model(tmp_path / "c", seed=1))
    assert a == b
    assert a["model.safetensors"] != c["model.safetensors"]
    assert set(a) == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    }


def test_remaking_replaces_the_directory_whole(tmp_path: Path) -> None:
    out = tmp_path / "m"
    make_model(out, seed=1)
    (out / "stray.bin").write_bytes(b"x")
    make_model(out, seed=0)
    assert not (out / "stray.bin").exists()
    assert _files(out) == _files(make_model(tmp_path / "again", seed=0))
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_write_that_fails_leaves_the_old_directory_and_no_scratch(tmp_path: Path) -> None:
    out = tmp_path / "m"
    make_model(out, seed=0)
    before = _files(out)
    with pytest.raises(OSError, match="disk full"), replacing_directory(out) as scratch:
        (scratch / "config.json").write_text("{}")
        raise OSError("disk full")
    assert _files(out) == before
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


def test_shape_fits_vllm_cpu_and_safetensors_is_consistent(tmp_path: Path) -> None:
    out = make_model(tmp_path / "m")
    config = json.loads((out / "config.json").read_text())
    assert config["hidden_size"] // config["num_attention_heads"] == config["head_dim"] == 32
    assert config["num_key_value_heads"] == 2
    assert config["torch_dtype"] == "bfloat16"
    raw = (out / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    data = len(raw) - 8 - n
    spans = sorted(v["data_offsets"] for k, v in header.items() if k != "__metadata__")
    assert spans[0][0] == 0 and spans[-1][1] == data
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        count = 1
        for d in entry["shape"]:
            count *= d
        assert entry["data_offsets"][1] - entry["data_offsets"][0] == 2 * count, name
    emb = header["model.embed_tokens.weight"]["shape"]
    assert emb == [config["vocab_size"], 128]


def test_tokenizer_is_byte_level_with_chat_template(tmp_path: Path) -> None:
    out = make_model(tmp_path / "m")
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    text = "héllo, wörld! 🙂 tabs\tand\nnewlines"
    assert tok.decode(tok.encode(text).ids) == text  # any bytes round-trip
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert "messages" in config["chat_template"]
    assert tok.token_to_id(config["bos_token"]) is not None
