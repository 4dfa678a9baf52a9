"""The client side: how a request arrives and how the client is answered.

Rule 1: speak to the client only. Nothing here knows a backend, a leg or a routing decision;
it authenticates, admits, reads and checks what the client sent, notices when the client
leaves, and shapes the errors the client sees.
Rule 2: nothing is allocated for a client before it is authenticated and admitted: a key
check and an admission slot come before the body is read.

:mod:`~pdproxy.front.protocol` (uvicorn's protocol reporting disconnects, gating connections),
:mod:`~pdproxy.front.connections` (connections waiting for a request head: deadline, budgets),
:mod:`~pdproxy.front.intake` (key, size, body, ``kv_transfer_params`` gate),
:mod:`~pdproxy.front.tenants` (each tenant's ``cache_salt``, ``cached_tokens`` hidden),
:mod:`~pdproxy.front.admission` (global and per-model slots),
:mod:`~pdproxy.front.cancel` (the client leaving cancels the request),
:mod:`~pdproxy.front.responses` (OpenAI-shaped errors).
"""
