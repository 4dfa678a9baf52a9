"""Typed errors of the reference worker (all are :class:`kvtier.errors.KvtierError`).

Hierarchy::

    KvtierError
    └── WorkerError              the worker refused or failed a request
        ├── InvalidRequest       a body the OpenAI API would answer with 400
        │   ├── ContextTooLong   prompt (+ max_tokens) longer than the model's context
        │   └── KVTransferRefused kv_transfer_params refused outright (400, counted): an id
        │                        over the length cap, a producer outside p2p_allowed_peers
        ├── EngineClosed         the engine is shutting down
        └── KVTransferParamsError malformed kv_transfer_params (the leg runs locally)
"""

from __future__ import annotations

from kvtier.errors import KvtierError


class WorkerError(KvtierError):
    """The worker refused or failed a request."""


class InvalidRequest(WorkerError, ValueError):
    """A request body that the OpenAI API would answer with 400."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ContextTooLong(InvalidRequest):
    """The prompt (plus the tokens asked for) does not fit the model's context."""


class KVTransferRefused(InvalidRequest):
    """``kv_transfer_params`` the worker refuses instead of running the leg locally: an id
    longer than :data:`kvtier.worker.kv_params.MAX_ID_CHARS`, or a consumer leg naming a
    producer outside ``p2p_allowed_peers``."""


class EngineClosed(WorkerError):
    """The engine is shutting down and accepts no request."""


class KVTransferParamsError(WorkerError, ValueError):
    """``kv_transfer_params`` that name neither dialect correctly."""
