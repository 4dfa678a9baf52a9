"""Processes: ``pdproxy serve --workers N``, N full proxies behind one port.

Rule 1: each process is a whole proxy (its own loop, backends, router, admission); processes
share nothing per request: no lock, socket or round trip on the hot path.
Rule 2: what must be seen as one (metrics, admin changes) goes over the siblings' private
Unix sockets, authenticated, off the request path.

:mod:`~pdproxy.serve.process_group` (bind, fork, supervise),
:mod:`~pdproxy.serve.siblings` (fan-out between processes),
:mod:`~pdproxy.serve.metrics_merge` (one ``/metrics`` for the group, merged at most once a second).
"""
