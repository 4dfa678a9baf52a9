"""The KV-aware router: residency from KV events, a cost per candidate summed from scorers.

Build it with :func:`pdproxy.routing.kv.build.build_kv_router`; the decision is
:mod:`~pdproxy.routing.kv.router` (the steps) over :mod:`~pdproxy.routing.kv.decide` (pure),
the signals :mod:`~pdproxy.routing.kv.scorers`, the state :mod:`~pdproxy.routing.kv.state`
(Redis: ``shared_*``, ``store_guard``, ``stream_leases``), the I/O that feeds it
``event_feeds`` and ``engine_scrape``. Its settings are the proxy's ``router_options``
(:mod:`pdproxy.settings.routing`, :mod:`pdproxy.settings.scorers`).
"""
