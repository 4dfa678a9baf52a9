"""Prompt → token ids, by backend pool, for the KV-aware router.

``bytes`` (the reference worker's tokenizer), a local Hugging Face ``tokenizer.json`` with its
chat template, or the backend's ``/tokenize``; build one with
:func:`pdproxy.tokenize.build.build_tokenizer`.
"""

from pdproxy.tokenize.settings import TokenizerKind, TokenizerSettings

__all__ = ["TokenizerKind", "TokenizerSettings"]
