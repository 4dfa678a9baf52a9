"""What operators see: Prometheus metrics and the W3C trace context.

Rule 1: observing never changes an outcome and never blocks a request: a metric is a counter
bump with pre-bound labels, a malformed trace header is dropped, not refused.
Rule 2: label values come from the proxy's own vocabulary (backend names, routes, model names
the catalog knows), never from a string a client chose.

:mod:`~pdproxy.observe.metrics`, :mod:`~pdproxy.observe.trace_context`. Spans live with the
request (:mod:`pdproxy.request.trace`); their settings in :mod:`pdproxy.settings.tracing`.
"""
