"""Engine integrations: adapters that run inside an inference engine and talk to kvswapd.

One package per engine (:mod:`kvswap.engines.vllm`, later others). An adapter imports its
engine's own packages (vLLM, torch) and :mod:`kvswap.protocol`, never the daemon or the
backends (tests/test_import_graph.py). ``kvswap.protocol`` stays the wire protocol alone and
imports with numpy; nothing here is imported unless an engine loads it.
"""
