"""The KV-aware router: residency from KV events, tier-weighted cost with load.

``KvRouterSettings`` is exported here so proxy settings can embed it without importing the
router; build the router with :func:`pdproxy.routing.kv.build.build_kv_router`.
"""

from pdproxy.routing.kv.settings import CostWeights, KvRouterSettings, LocalPrefillThresholds

__all__ = ["CostWeights", "KvRouterSettings", "LocalPrefillThresholds"]
