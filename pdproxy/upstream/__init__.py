"""Bytes to and from engines: pooled HTTP/1.1 keep-alive connections.

Rule 1: knows nothing of requests, routing or backends' health: it sends what it is given to
the URL it is given and reports what came back (status, headers, body chunks) or why nothing
did, as :class:`~pdproxy.errors.LegFailed` and its kin.
Rule 2: every wait has a deadline, and a connection that saw anything unexpected is closed,
never returned to its pool.

:mod:`~pdproxy.upstream.conn` (one connection, the httptools parser),
:mod:`~pdproxy.upstream.pool` (per-origin pools), :mod:`~pdproxy.upstream.client` (legs).
"""
