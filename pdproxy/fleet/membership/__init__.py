"""Dynamic backend membership: backends found by DNS or announced by workers.

Rule 1: configuration wins: a discovered or announced backend never replaces a configured one.
Rule 2: every source adds and drains through one mechanism (:class:`Membership`), so a backend
leaves the same way whoever found it.

Two sources feed one mechanism. :mod:`~pdproxy.fleet.membership.dns` re-resolves DNS names (A/AAAA,
SRV) on an interval; :mod:`~pdproxy.fleet.membership.registration` listens for workers'
announcements (vLLM's ZMQ registration format, CURVE-authenticated) and their heartbeats. Both add
backends to the :class:`~pdproxy.fleet.backends.BackendRegistry` and drain them through
:class:`~pdproxy.fleet.membership.members.Membership`, which removes a drained backend once no leg
is in flight on it. :class:`~pdproxy.fleet.membership.service.MembershipService` wires them for the
app.

Its settings are :mod:`pdproxy.settings.membership`.
"""
