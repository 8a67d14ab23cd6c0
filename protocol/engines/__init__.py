"""The vLLM connector's old home: it moved to :mod:`kvswap.engines.vllm` (issue 23), since
``kvswap.protocol`` is the wire protocol alone.

Only ``vllm_connector`` stays here, as a shim, because vLLM configs name it
(``kv_connector_module_path``). The package goes in kvswap 0.2.0.
"""
