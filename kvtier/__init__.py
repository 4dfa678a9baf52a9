"""kvtier: worker-side KV-cache tiering for prefill/decode disaggregation.

Subpackages that the proxy may import (``keys``, ``events``, ``residency``) never import torch;
``pages``, ``p2p`` and ``worker`` do.
"""

__version__ = "0.1.0"
