"""Low-level code both sides of kvswap share: the engine side (:mod:`kvswap.protocol`, the
engine integrations) and the daemon's (:mod:`kvswap.daemon`, :mod:`kvswap.backends`).

- :mod:`.errors`: the exception root and a class per wire code (the wire table and form are
  :mod:`kvswap.protocol.errors`, which re-exports them);
- :mod:`.units`: the page size and the one rule for writing a size;
- :mod:`.shm`: POSIX shared-memory segments (the engine creates, the daemon attaches);
- :mod:`.cuda_driver`: the CUDA driver API through ctypes (engine-side export, daemon movers);
- :mod:`.processes`: whether a process is alive.

It imports nothing of the rest of kvswap (tests/test_import_graph.py) and nothing beyond the
standard library at module level, so ``import kvswap.protocol`` still needs numpy alone.
"""
