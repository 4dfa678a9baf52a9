"""Settings of mid-stream failover (:mod:`pdproxy.failover`)."""

from __future__ import annotations

from pydantic import BaseModel, Field


class FailoverSettings(BaseModel):
    """``max_migrations`` 0 (the default) keeps today's behaviour: a consumer failing after the
    first byte ends the stream with an error event. 1 or 2: the stream moves to another consumer
    that many times at most."""

    max_migrations: int = Field(default=0, ge=0, le=2)
