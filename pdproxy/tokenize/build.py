"""A pool's tokenizer from its settings."""

from __future__ import annotations

from pdproxy.errors import ConfigError
from pdproxy.settings.routing import TokenizerKind, TokenizerSettings
from pdproxy.tokenize.base import OffLoopTokenizer, Tokenizer
from pdproxy.tokenize.byte_level import ByteEncoder
from pdproxy.tokenize.hf import HfEncoder
from pdproxy.tokenize.remote import BackendTokenizer


def build_tokenizer(settings: TokenizerSettings, backend_url: str | None = None) -> Tokenizer:
    """``backend_url`` is the pool's first backend, used by ``kind=backend`` without ``url``."""
    if settings.kind is TokenizerKind.BYTES:
        return OffLoopTokenizer(ByteEncoder(), settings.offload_threshold_chars)
    if settings.kind is TokenizerKind.HF:
        if not settings.path:
            raise ConfigError("tokenizer kind 'hf' needs a path to a tokenizer directory")
        return OffLoopTokenizer(HfEncoder.from_dir(settings.path), settings.offload_threshold_chars)
    url = settings.url or backend_url
    if not url:
        raise ConfigError("tokenizer kind 'backend' needs a url")
    return BackendTokenizer(url, settings.model, settings.timeout_s)
