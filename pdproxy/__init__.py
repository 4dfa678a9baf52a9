"""pdproxy: an OpenAI-compatible prefill/decode disaggregation proxy.

Never imports torch: the proxy installs and runs without the worker side.
"""

__version__ = "0.1.0"
