"""kvswap: a KV-cache transfer daemon for LLM serving.

The engine-facing API lives in :mod:`kvswap.protocol`; the daemon in :mod:`kvswap.daemon`;
storage tiers in :mod:`kvswap.backends`.
"""

__version__ = "0.1.0"
