"""The engine-reported load term of a node's cost (pure), in prefill-token equivalents.

With a fresh reading (engine: ``W`` waiting, ``R`` running, KV usage ``u``; this proxy had
``I0`` requests in flight on the node when it was scraped)::

    external = max(W + R - I0, 0)                   requests the engine holds for others
    term     = in_flight_tokens       * external
             + waiting_request_tokens * W           the engine cannot even start them
             + kv_usage_tokens * max(u - knee, 0) / (1 - knee)

The router's own in-flight charge (``in_flight_tokens * I``, with ``I`` the current count) is
added by :func:`~pdproxy.routing.kv.cost.load_cost` as before, so a request this proxy sent is
charged once as a request, never twice. Subtracting ``I0`` (the count at scrape time, not the
current one) keeps the two figures from the same moment. Requests of ours that the engine does
not hold yet (a consumer leg waiting for its producer) make ``external`` too small, never too
large: the error is toward the old behaviour. The waiting term is charged for every waiting
request, ours included: the proxy's count cannot tell a running request from a queued one, the
engine's can.

No reading, or one older than the staleness bound: the term is 0 (own in-flight count only).
"""

from __future__ import annotations

from pdproxy.routing.kv.engine_load import EngineReading
from pdproxy.routing.kv.settings import CostWeights
from pdproxy.routing.kv.signal_settings import EngineLoadSettings


def external_requests(reading: EngineReading) -> int:
    """Requests the engine reported that this proxy had not sent (at scrape time)."""
    s = reading.sample
    return max(s.waiting + s.running - reading.own_in_flight, 0)


def engine_load_tokens(
    reading: EngineReading | None, weights: CostWeights, settings: EngineLoadSettings
) -> float:
    """The term added to a node's load cost (0.0 without a fresh reading)."""
    if reading is None:
        return 0.0
    s = reading.sample
    term = weights.in_flight_tokens * external_requests(reading)
    term += settings.waiting_request_tokens * s.waiting
    if s.kv_usage is not None and s.kv_usage > settings.kv_usage_knee:
        over = (s.kv_usage - settings.kv_usage_knee) / (1.0 - settings.kv_usage_knee)
        term += settings.kv_usage_tokens * min(over, 1.0)
    return term
