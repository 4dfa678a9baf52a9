"""How a backend pool's prompts are turned into token ids: the ``tokenizer`` section of
``router_options``, defined with the settings tree (:mod:`pdproxy.settings.routing`) so that it
is validated when the config is loaded."""

from pdproxy.settings.routing import TokenizerKind, TokenizerSettings

__all__ = ["TokenizerKind", "TokenizerSettings"]
