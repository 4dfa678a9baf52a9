"""Prompt → token ids, by backend pool, for the KV-aware router.

Rule 1: tokenizing never blocks the event loop: long prompts go to a thread.
Rule 2: a tokenizer that fails says so (:mod:`~pdproxy.tokenize.errors`); the router then
routes by load alone, the request is never refused for it.

``bytes`` (the reference worker's tokenizer), a local Hugging Face ``tokenizer.json`` with its
chat template, or the backend's ``/tokenize``; build one with
:func:`pdproxy.tokenize.build.build_tokenizer` from a
:class:`~pdproxy.settings.routing.TokenizerSettings` (``router_options.tokenizer``).
"""
