"""Deprecated path of the vLLM connector, for vLLM configs written before issue 23 that name
``"kv_connector_module_path": "kvswap.protocol.engines.vllm_connector"``.

The connector is :mod:`kvswap.engines.vllm.connector` now; set that path instead. This shim
re-exports the class vLLM looks up by name and goes in kvswap 0.2.0.
"""

import warnings

from kvswap.engines.vllm.connector import KvswapConnector

__all__ = ["KvswapConnector"]

warnings.warn("kvswap.protocol.engines.vllm_connector is deprecated and goes in kvswap 0.2.0; set "
              "kv_connector_module_path to kvswap.engines.vllm.connector", DeprecationWarning, stacklevel=2)
