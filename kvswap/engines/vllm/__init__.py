"""vLLM's KV connector: ``kvswap.engines.vllm.connector.KvswapConnector`` is the
``KVConnectorBase_V1`` plug-in (docs/integration.md).

``connector`` and ``worker`` import vLLM and torch at import time (only vLLM imports them);
``plan``, ``policy`` and ``stats`` are plain Python, tested without either. This ``__init__``
imports nothing, so those three load without vLLM.
"""
