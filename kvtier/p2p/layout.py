"""The layout fingerprint two peers must share before any page crosses between them.

A page is only meaningful to a peer that hashes blocks the same way (hash seed, block size) and
lays KV out the same way (dtype, page bytes per KV-cache group). The fingerprint travels in the
handshake; any difference refuses the connection with a reason naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvtier.errors import ProtocolError
from kvtier.keys import OFFLOAD_KEY_BYTES, OffloadKey, split_offload_key


@dataclass(frozen=True, slots=True)
class LayoutFingerprint:
    """What a page means: hashing and KV layout of one model on one worker."""

    hash_seed: str
    block_size: int
    dtype: str
    page_bytes: tuple[int, ...]
    """Bytes of one offloaded page (chunk) per KV-cache group, indexed by group."""

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if not self.page_bytes or any(n <= 0 for n in self.page_bytes):
            raise ValueError(f"page_bytes must be positive per group, got {self.page_bytes}")

    def to_wire(self) -> dict[str, object]:
        return {
            "hash_seed": self.hash_seed,
            "block_size": self.block_size,
            "dtype": self.dtype,
            "page_bytes": list(self.page_bytes),
        }

    @classmethod
    def from_wire(cls, raw: object) -> LayoutFingerprint:
        """Parse a handshake's fingerprint map; raises ProtocolError for anything malformed."""
        if not isinstance(raw, Mapping):
            raise ProtocolError("fingerprint is not a map")
        seed, bs, dtype, pages = (
            raw.get("hash_seed"),
            raw.get("block_size"),
            raw.get("dtype"),
            raw.get("page_bytes"),
        )
        if not isinstance(seed, str) or not isinstance(dtype, str):
            raise ProtocolError("fingerprint hash_seed/dtype must be strings")
        if not isinstance(bs, int) or isinstance(bs, bool):
            raise ProtocolError("fingerprint block_size must be an integer")
        if not isinstance(pages, list | tuple) or len(pages) > 1024:
            raise ProtocolError("fingerprint block_size/page_bytes malformed")
        if not all(_is_int(n) for n in pages):
            raise ProtocolError("fingerprint page_bytes must be integers")
        try:
            return cls(seed, bs, dtype, tuple(pages))
        except ValueError as exc:
            raise ProtocolError(f"fingerprint invalid: {exc}") from exc

    def mismatch(self, other: LayoutFingerprint) -> str | None:
        """A reason naming the first differing field, or None when both agree."""
        for name in ("hash_seed", "block_size", "dtype", "page_bytes"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                return f"layout fingerprint mismatch: {name} {mine!r} != {theirs!r}"
        return None

    def page_nbytes(self, key: OffloadKey) -> int:
        """Payload size of ``key``'s page; raises ProtocolError for a malformed key or group."""
        if len(key) != OFFLOAD_KEY_BYTES:
            raise ProtocolError(f"offload key must be {OFFLOAD_KEY_BYTES} bytes, got {len(key)}")
        _, group = split_offload_key(key)
        if group >= len(self.page_bytes):
            raise ProtocolError(f"key names group {group}; the layout has {len(self.page_bytes)}")
        return self.page_bytes[group]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
