from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.errors import InvalidTokensError
from kvtier.keys import (
    BLOCK_HASH_BYTES,
    OFFLOAD_KEY_BYTES,
    BlockHasher,
    chunk_offload_keys,
    offload_key,
    split_offload_key,
)

tokens = st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=200)
HASHER = BlockHasher("model-a", block_size=4)


@given(tokens, tokens)
def test_prefix_property(a: list[int], b: list[int]) -> None:
    ha = HASHER.hash_tokens(a)
    hab = HASHER.hash_tokens(a + b)
    assert len(ha) == len(a) // 4
    assert len(hab) == len(a + b) // 4
    assert hab[: len(ha)] == ha
    assert all(len(h) == BLOCK_HASH_BYTES for h in hab)


@given(tokens.filter(lambda t: len(t) >= 4))
def test_seed_and_salt_separate_chains(t: list[int]) -> None:
    base = HASHER.hash_tokens(t)
    assert set(base).isdisjoint(BlockHasher("model-b", block_size=4).hash_tokens(t))
    salted = HASHER.hash_tokens(t, cache_salt="tenant-1")
    assert set(base).isdisjoint(salted)
    assert set(salted).isdisjoint(HASHER.hash_tokens(t, cache_salt="tenant-2"))


def test_salt_affects_block_zero_only_through_the_chain() -> None:
    t = list(range(12))
    salted = HASHER.hash_tokens(t, cache_salt="s")
    # Block 1 of the salted chain is a plain link from salted block 0 (no salt again).
    cont = HASHER.hash_tokens(t[4:], parent=salted[0], first_block_index=1, cache_salt="s")
    assert cont == salted[1:]


def test_different_tokens_different_hash() -> None:
    assert HASHER.hash_tokens([1, 2, 3, 4]) != HASHER.hash_tokens([1, 2, 3, 5])


def test_partial_trailing_block_not_hashed() -> None:
    assert HASHER.hash_tokens([1, 2, 3]) == []
    assert len(HASHER.hash_tokens(list(range(7)))) == 1


def test_deterministic_across_processes() -> None:
    code = (
        "from kvtier.keys import BlockHasher;"
        "print(BlockHasher('m', 16).hash_tokens(list(range(100)), cache_salt='x')[-1].hex())"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        for seed in ("0", "1", "12345")
    }
    assert len(outs) == 1
    assert (
        outs.pop().strip()
        == BlockHasher("m", 16).hash_tokens(list(range(100)), cache_salt="x")[-1].hex()
    )


@given(tokens, st.lists(tokens, max_size=5))
def test_incremental_equals_one_shot(first: list[int], turns: list[list[int]]) -> None:
    inc = HASHER.start(cache_salt="salt")
    inc.extend(first)
    everything = list(first)
    for turn in turns:
        new = inc.extend(turn)
        before = len(everything) // 4
        everything += turn
        assert len(new) == len(everything) // 4 - before
    assert inc.hashes == HASHER.hash_tokens(everything, cache_salt="salt")
    assert inc.num_tokens == len(everything)


@pytest.mark.parametrize("bad", [[-1], [2**32], ["a"], [1.5]])
def test_invalid_tokens_raise_typed_error(bad: list[object]) -> None:
    with pytest.raises(InvalidTokensError):
        HASHER.hash_tokens(bad)  # type: ignore[arg-type]
    inc = HASHER.start()
    with pytest.raises(InvalidTokensError):
        inc.extend(bad)  # type: ignore[arg-type]
    assert inc.num_tokens == 0


@given(st.binary(min_size=16, max_size=16), st.integers(min_value=0, max_value=65535))
def test_offload_key_round_trip(h: bytes, group: int) -> None:
    from kvtier.keys import BlockHash

    key = offload_key(BlockHash(h), group)
    assert len(key) == OFFLOAD_KEY_BYTES
    assert split_offload_key(key) == (h, group)


@given(st.integers(min_value=0, max_value=40), st.integers(min_value=1, max_value=8))
def test_chunk_keys_use_each_full_chunks_last_block(n_blocks: int, per_chunk: int) -> None:
    hashes = HASHER.hash_tokens(list(range(n_blocks * 4)))
    keys = chunk_offload_keys(hashes, per_chunk, group=1)
    assert len(keys) == n_blocks // per_chunk
    for i, key in enumerate(keys):
        assert split_offload_key(key) == (hashes[(i + 1) * per_chunk - 1], 1)


def test_groups_separate_keys() -> None:
    h = HASHER.hash_tokens([1, 2, 3, 4])[0]
    assert offload_key(h, 0) != offload_key(h, 1)
    with pytest.raises(ValueError):
        offload_key(h, 70000)
