"""Predicted time to first token, in milliseconds, per candidate (producer, consumer) pair.

Rule: the prediction is a pure function of a frozen snapshot (:mod:`.predict`); the learned
rates are state (:mod:`.rates`) that only the TTFT scorer writes, from the legs' observed
timings, on the router's event loop. Nothing here does I/O.

- :mod:`.fit`: a line ``ms = intercept + slope x work`` learned online (bounded, decaying);
- :mod:`.rates`: each node's lines and its prefill backlog, seeded for a node nothing is known
  of;
- :mod:`.predict`: each way of serving a request (a pair, or a consumer alone), its predicted
  TTFT, and the choice against the request's target.

The scorer that plugs this into the router is :mod:`pdproxy.routing.kv.scorers.ttft`.
"""
