"""The fleet: which backends exist, what they serve, and whether they can take traffic.

Rule 1: the registry owns every :class:`~pdproxy.fleet.backends.Backend`; others read it
through views (a router sees :class:`~pdproxy.routing.base.BackendView`), and only the
registry, health checks, breakers and membership change it.
Rule 2: a backend leaves only by draining: it takes no new request, and is removed once no leg
is in flight on it.

:mod:`~pdproxy.fleet.backends` (backends, breakers, the registry),
:mod:`~pdproxy.fleet.health`, :mod:`~pdproxy.fleet.dp_ranks`, :mod:`~pdproxy.fleet.models`
(the model catalog and ``/v1/models``), :mod:`~pdproxy.fleet.membership` (DNS, registration).
"""
