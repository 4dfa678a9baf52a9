"""Where ``loadtest.bench_signals`` finds the engine-load and index-exactness settings; they are
defined in :mod:`pdproxy.settings.scorers` (import them from :mod:`pdproxy.routing.kv.settings`)."""

from pdproxy.settings.scorers import EngineLoadSettings, IndexExactnessSettings

__all__ = ["EngineLoadSettings", "IndexExactnessSettings"]
