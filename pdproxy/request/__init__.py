"""One client request, from its body to the last byte relayed: the request path.

Rule 1: one owner per lifetime. Everything a request takes (admission slot, in-flight counts,
P2P supplies, the router's ticket, the disconnect watcher, the trace) belongs to its
:class:`~pdproxy.request.lease.RequestLease` and is given back in exactly one place, when the
lease closes. The lease holds nothing else.
Rule 2: the path reads as a straight line: route, producer phase, consumer phase, relay; each
phase takes its inputs as arguments and returns its result, which the path writes into the
request's :class:`~pdproxy.request.record.RequestRecord` (read once, at the end).

:mod:`~pdproxy.request.path` (the line), :mod:`~pdproxy.request.lease`,
:mod:`~pdproxy.request.producer`, :mod:`~pdproxy.request.consumer`,
:mod:`~pdproxy.request.relay`, :mod:`~pdproxy.request.legs` (leg bodies, dialects),
:mod:`~pdproxy.request.retry`, :mod:`~pdproxy.request.failover` with
:mod:`~pdproxy.request.continuation` and :mod:`~pdproxy.request.stream_ledger` (mid-stream
failover), :mod:`~pdproxy.request.release`
(P2P supplies), :mod:`~pdproxy.request.record` (ids, what the request did),
:mod:`~pdproxy.request.trace` (spans, optional).
"""
