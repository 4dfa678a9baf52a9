"""The KV router's settings, as its code imports them.

They are defined with the proxy's settings tree (:mod:`pdproxy.settings.routing`, the scorers'
sections in :mod:`pdproxy.settings.scorers`) so that ``router_options`` is validated when the
config is loaded; this module is the KV router's face for them.
"""

from pdproxy.settings.routing import (
    EventsCurveSettings,
    KvRouterSettings,
    LocalPrefillThresholds,
    TokenizerSettings,
)
from pdproxy.settings.scorers import (
    AffinitySettings,
    CostWeights,
    EngineLoadSettings,
    IndexExactnessSettings,
    PullSettings,
)

__all__ = [
    "AffinitySettings",
    "CostWeights",
    "EngineLoadSettings",
    "EventsCurveSettings",
    "IndexExactnessSettings",
    "KvRouterSettings",
    "LocalPrefillThresholds",
    "PullSettings",
    "TokenizerSettings",
]
