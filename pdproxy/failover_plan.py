"""Which streams may migrate, and what a migrating stream knows of its request.

:class:`StreamFailover` (one per request path) turns ``failover.max_migrations`` and a request's
body into a :class:`MigrationPlan`, or None; the plan builds the first consumer leg (asking for
the running token count), each continuation leg (:mod:`pdproxy.continuation`) and the chunk
shapers of :class:`~pdproxy.failover.MigratingRelay`, which does the migrating.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter

from pdproxy.body import ClientBody
from pdproxy.continuation import continuation_body, first_leg, migration_refusal
from pdproxy.failover_settings import FailoverSettings
from pdproxy.metrics import ProxyMetrics
from pdproxy.stream_ledger import ChunkShaper, StreamLedger
from pdproxy.upstream import Upstream

log = logging.getLogger(__name__)


class StreamFailover:
    """One per request path: decides which streams may migrate and counts what happened."""

    def __init__(
        self,
        settings: FailoverSettings,
        upstream: Upstream,
        metrics: ProxyMetrics,
        *,
        first_attempts: int,
    ) -> None:
        self._settings = settings
        self._upstream = upstream
        self._first_attempts = first_attempts
        self.migrations = Counter(
            "pdproxy_stream_migrations",
            "Consumer failures after a stream's first byte, by what the proxy did: migrated "
            "(a continuation leg took over), closed (the answer was complete; the proxy ended "
            "the stream), refused (the request cannot continue exactly), exhausted (no "
            "migration left or no consumer answered)",
            ["outcome"],
            registry=metrics.registry,
        )

    def plan(self, route: str, body: ClientBody, stream: bool) -> MigrationPlan | None:
        """The request's migration plan; None when failover is off or the answer is whole."""
        if not stream or self._settings.max_migrations == 0:
            return None
        refusal = migration_refusal(route, body.data)
        if refusal is not None:
            log.debug("stream of route %s will not migrate: %s", route, refusal)
            return None
        opts = body.data.get("stream_options")
        opts = opts if isinstance(opts, dict) else {}
        return MigrationPlan(
            failover=self,
            route=route,
            body=body,
            client_usage=opts.get("include_usage") is True,
            client_continuous=opts.get("include_usage") is True
            and opts.get("continuous_usage_stats") is True,
        )

    @property
    def max_migrations(self) -> int:
        return self._settings.max_migrations

    @property
    def upstream(self) -> Upstream:
        return self._upstream

    @property
    def first_attempts(self) -> int:
        return self._first_attempts


@dataclass(frozen=True, slots=True)
class MigrationPlan:
    """What a migrating stream needs to know of its request."""

    failover: StreamFailover
    route: str
    body: ClientBody
    client_usage: bool
    client_continuous: bool

    def first_leg(self, kv_params: dict[str, Any] | None) -> bytes:
        data = first_leg(self.body.data)
        if kv_params is not None:
            data["kv_transfer_params"] = kv_params
        return self.body.encode(data)

    def continuation(self, ledger: StreamLedger) -> bytes | str:
        made = continuation_body(self.route, self.body.data, ledger)
        return made if isinstance(made, str) else self.body.encode(made)

    def shaper(self, ledger: StreamLedger, continuation: bool) -> ChunkShaper:
        return ChunkShaper(
            ledger,
            continuation=continuation,
            client_usage=self.client_usage,
            client_continuous=self.client_continuous,
        )
