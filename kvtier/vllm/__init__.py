"""kvtier as a vLLM KV connector (imports vLLM; only vLLM imports this package).

``connector`` (the ``KVConnectorBase_V1`` facade vLLM loads), ``scheduler`` (scheduler side:
which requests move KV), ``worker`` (worker side: host pages, tiering manager, P2P server and
client), ``metadata`` (scheduler → worker per step), ``copies`` (vLLM KV blocks ↔ host pages),
``loop`` (the network thread), ``offers`` (scheduler side of ``remote_kv_source``: offers to a
holder), ``layout`` (the P2P layout fingerprint both sides compute), ``stats`` (telemetry on
vLLM's ``/metrics``), ``settings`` (``kv_connector_extra_config``), ``errors``.
"""
