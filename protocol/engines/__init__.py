"""Engine adapters: code that runs inside an inference engine and talks to kvswapd.

Each adapter imports its engine's packages (vLLM, torch) only when it is used, so
``kvswap.protocol`` keeps importing with numpy alone. ``vllm_connector`` is vLLM's
``KVConnectorBase_V1`` plug-in; see docs/integration.md.
"""
