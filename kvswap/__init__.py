"""kvswap: a KV-cache transfer daemon for LLM serving.

The engine-facing API lives in :mod:`kvswap.protocol`; the daemon in :mod:`kvswap.daemon`;
storage tiers in :mod:`kvswap.backends`; adapters that run inside an engine (the vLLM
connector) in :mod:`kvswap.engines`; the low-level code both sides share in
:mod:`kvswap.common`; helpers of the tests and benchmarks in :mod:`kvswap.testing`.

The three code folders sit at the top of the repository (the design card fixes them there);
this directory is the import package, and ``daemon``, ``protocol`` and ``backends`` here are
symlinks to them. So ``kvswap.daemon.server`` *is* ``daemon/server.py`` for Python, for type
checkers and editors reading a plain checkout, and for the wheel (which holds the files).
``common``, ``engines`` and ``testing`` are real directories here (a new top-level folder
named like a standard-library module would shadow it).
"""

__version__ = "0.1.0"
