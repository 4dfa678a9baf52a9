"""pdproxy: an OpenAI-compatible prefill/decode disaggregation proxy.

The package is folders by role, in layers; a part imports its own layer and those below,
never one above (``tests/pdproxy/test_layout.py`` checks it, ``TYPE_CHECKING`` imports too):

====================  =====================================================================
layer (top first)     parts
====================  =====================================================================
processes             ``app`` (``create_app``), ``admin``, ``cli``, ``serve/``, ``stack/``
one request           ``request/``: the path, its lease, the producer and consumer phases
decisions, clients    ``routing/`` (filters -> scorers -> picker), ``front/`` (the client side)
the fleet             ``fleet/``: backends and breakers, health, DP ranks, models, membership
I/O and telemetry     ``upstream/`` (HTTP/1.1 to engines), ``observe/``, ``tokenize/``
vocabulary            ``settings/``, ``errors``, ``origin``
====================  =====================================================================

Never imports torch: the proxy installs and runs without the worker side.
"""

__version__ = "0.1.0"
