"""Typed errors of prompt tokenization.

Hierarchy::

    pdproxy.errors.ProxyError
    └── TokenizationError          a prompt could not be turned into token ids
        └── TokenizerUnavailable   the tokenizer's files or backend endpoint failed

The KV-aware router catches ``TokenizationError`` and routes the request by load alone: a
request never fails because it could not be hashed.
"""

from __future__ import annotations

from pdproxy.errors import ProxyError


class TokenizationError(ProxyError):
    """A prompt could not be turned into token ids."""


class TokenizerUnavailable(TokenizationError):
    """The tokenizer could not be loaded, or the backend's ``/tokenize`` failed or timed out."""
