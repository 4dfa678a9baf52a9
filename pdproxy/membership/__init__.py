"""Dynamic backend membership: backends found by DNS or announced by workers.

Two sources feed one mechanism. :mod:`~pdproxy.membership.dns` re-resolves DNS names (A/AAAA,
SRV) on an interval; :mod:`~pdproxy.membership.registration` listens for workers' announcements
(vLLM's ZMQ registration format, CURVE-authenticated) and their heartbeats. Both add backends to
the :class:`~pdproxy.backends.BackendRegistry` and drain them through
:class:`~pdproxy.membership.members.Membership`, which removes a drained backend once no leg is
in flight on it. :class:`~pdproxy.membership.service.MembershipService` wires them for the app.

Nothing is imported here, so that ``pdproxy.settings`` can import
:mod:`pdproxy.membership.settings` without a cycle.
"""
