"""The reference worker: a small OpenAI-compatible engine embedding kvtier.

``engine`` (paged KV pools, prefix cache, scheduler, sampling) runs one of two compute backends
(``backends.tiny``: a small Llama-style decoder in torch; ``backends.sim``: no arithmetic, page
bytes derived from block hashes). ``server`` puts the OpenAI endpoints in front of it and
``connector`` speaks ``kv_transfer_params`` in the P2P and NIXL-shaped dialects.
"""
