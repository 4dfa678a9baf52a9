"""Token blocks → chained 128-bit block hashes, and offload keys.

``h[i] = xxh3_128(h[i-1] ‖ tokens_i ‖ extra_i)`` where ``tokens_i`` is block ``i``'s token ids as
little-endian uint32 and ``h[-1]`` is derived from a seed string naming the model. A cache salt
goes into block 0's extra only, so two tenants with different salts share no block while each
tenant's chain still has the prefix property. A LoRA adapter's name goes into every block's extra
(before the salt in block 0), as vLLM keeps it in every block's extra keys: blocks computed
under an adapter never match the base model's or another adapter's. Only full blocks are hashed.

Hashes depend on nothing but their inputs (no ``hash()``, no PYTHONHASHSEED), so a router and a
worker in different processes agree on them.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NewType

import xxhash

from kvtier.errors import InvalidTokensError

BlockHash = NewType("BlockHash", bytes)
"""16 bytes: the chained hash of one full block."""

OffloadKey = NewType("OffloadKey", bytes)
"""18 bytes: the hash of a chunk's last block followed by the KV-cache group index (uint16 BE)."""

DEFAULT_BLOCK_SIZE = 16
BLOCK_HASH_BYTES = 16
_GROUP_BYTES = 2
OFFLOAD_KEY_BYTES = BLOCK_HASH_BYTES + _GROUP_BYTES
MAX_GROUPS = 1 << (8 * _GROUP_BYTES)
_SEED_DOMAIN = b"kvtier/block-hash/v1\x00"
_SALT_DOMAIN = b"\x00salt\x00"
_LORA_DOMAIN = b"\x00lora\x00"
_BIG_ENDIAN_HOST = sys.byteorder == "big"


def encode_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 bytes; raises InvalidTokensError for anything else."""
    try:
        buf = array("I", token_ids)
    except (OverflowError, TypeError) as exc:
        raise InvalidTokensError(f"token ids must be integers in [0, 2**32): {exc}") from exc
    if buf.itemsize != 4:  # pragma: no cover - every supported platform has 4-byte 'I'
        raise InvalidTokensError("platform has no 4-byte unsigned int array type")
    if _BIG_ENDIAN_HOST:  # pragma: no cover - CI is little-endian
        buf.byteswap()
    return buf.tobytes()


def root_hash(model_seed: str) -> BlockHash:
    """``h[-1]``: the parent of block 0, naming the model so different models never collide."""
    return BlockHash(xxhash.xxh3_128_digest(_SEED_DOMAIN + model_seed.encode("utf-8")))


def salt_extra(cache_salt: str | None) -> bytes:
    """Block 0's extra for a cache salt (empty when there is none)."""
    return b"" if not cache_salt else _SALT_DOMAIN + cache_salt.encode("utf-8")


def lora_extra(lora_name: str | None) -> bytes:
    """Every block's extra for a LoRA adapter (empty for the base model)."""
    return b"" if not lora_name else _LORA_DOMAIN + lora_name.encode("utf-8") + b"\x00"


@dataclass(frozen=True, slots=True)
class BlockHasher:
    """Hashes prompts for one model: its seed and block size."""

    model_seed: str
    block_size: int = DEFAULT_BLOCK_SIZE
    root: BlockHash = field(init=False)

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        object.__setattr__(self, "root", root_hash(self.model_seed))

    def hash_tokens(
        self,
        token_ids: Sequence[int],
        *,
        cache_salt: str | None = None,
        parent: BlockHash | None = None,
        first_block_index: int = 0,
        lora_name: str | None = None,
    ) -> list[BlockHash]:
        """Hashes of every full block of ``token_ids``.

        With ``parent`` and ``first_block_index`` the tokens continue an already hashed chain
        (the salt applies only when the chain starts at block 0). ``lora_name``: the blocks
        are computed under that LoRA adapter.
        """
        data = encode_tokens(token_ids)
        step = self.block_size * 4
        end = len(data) - len(data) % step
        prev: bytes = self.root if parent is None else parent
        out: list[BlockHash] = []
        if end == 0:
            return out
        digest = xxhash.xxh3_128_digest
        append = out.append
        # Block 0 carries the salt; the hot loop below stays free of branches and calls.
        lora = lora_extra(lora_name)
        extra0 = lora + (salt_extra(cache_salt) if first_block_index == 0 else b"")
        prev = digest(prev + data[:step] + extra0)
        append(BlockHash(prev))
        if lora:
            for i in range(step, end, step):
                prev = digest(prev + data[i : i + step] + lora)
                append(prev)  # type: ignore[arg-type]  # bytes is BlockHash at run time
            return out
        for i in range(step, end, step):
            prev = digest(prev + data[i : i + step])
            append(prev)  # type: ignore[arg-type]  # bytes is BlockHash at run time
        return out

    def start(self, cache_salt: str | None = None, lora_name: str | None = None) -> PromptHashes:
        """An empty incremental hasher (e.g. for a conversation that grows turn by turn)."""
        return PromptHashes(self, cache_salt, lora_name)


class PromptHashes:
    """Incremental hashing: extending the prompt hashes only the new full blocks.

    Multi-turn chat appends to the history; rehashing it every turn would cost O(n²).
    """

    __slots__ = ("_hasher", "_lora", "_pending", "_salt", "hashes")

    def __init__(
        self, hasher: BlockHasher, cache_salt: str | None = None, lora_name: str | None = None
    ) -> None:
        self._hasher = hasher
        self._salt = cache_salt
        self._lora = lora_name
        self._pending: list[int] = []
        self.hashes: list[BlockHash] = []

    @property
    def num_tokens(self) -> int:
        return len(self.hashes) * self._hasher.block_size + len(self._pending)

    def extend(self, token_ids: Sequence[int]) -> list[BlockHash]:
        """Append tokens; returns the hashes of the blocks this completed."""
        encode_tokens(token_ids)  # validate before mutating state
        self._pending.extend(token_ids)
        bs = self._hasher.block_size
        n_full = len(self._pending) // bs
        if n_full == 0:
            return []
        ready, self._pending = self._pending[: n_full * bs], self._pending[n_full * bs :]
        new = self._hasher.hash_tokens(
            ready,
            cache_salt=self._salt,
            parent=self.hashes[-1] if self.hashes else None,
            first_block_index=len(self.hashes),
            lora_name=self._lora,
        )
        self.hashes.extend(new)
        return new


def offload_key(block_hash: BlockHash, group: int) -> OffloadKey:
    """The key of a chunk: its last block's hash and its KV-cache group."""
    if len(block_hash) != BLOCK_HASH_BYTES:
        raise ValueError(f"block hash must be {BLOCK_HASH_BYTES} bytes, got {len(block_hash)}")
    if not 0 <= group < MAX_GROUPS:
        raise ValueError(f"group index out of range: {group}")
    return OffloadKey(block_hash + group.to_bytes(_GROUP_BYTES, "big"))


def split_offload_key(key: OffloadKey) -> tuple[BlockHash, int]:
    """Inverse of :func:`offload_key`."""
    if len(key) != OFFLOAD_KEY_BYTES:
        raise ValueError(f"offload key must be {OFFLOAD_KEY_BYTES} bytes, got {len(key)}")
    return BlockHash(key[:BLOCK_HASH_BYTES]), int.from_bytes(key[BLOCK_HASH_BYTES:], "big")


def chunk_offload_keys(
    block_hashes: Sequence[BlockHash], blocks_per_chunk: int, group: int
) -> list[OffloadKey]:
    """Keys of every full chunk of ``blocks_per_chunk`` blocks (a partial tail chunk has none)."""
    if blocks_per_chunk <= 0:
        raise ValueError(f"blocks_per_chunk must be positive, got {blocks_per_chunk}")
    return [
        offload_key(block_hashes[end - 1], group)
        for end in range(blocks_per_chunk, len(block_hashes) + 1, blocks_per_chunk)
    ]
