"""The vLLM connector's plain-Python parts: which daemon, which keys, when to try again.
No vLLM or torch here, so the suite tests them without an engine."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvswap.protocol.client import DEFAULT_ENDPOINT
from kvswap.protocol.errors import KvswapError
from kvswap.protocol.kv_events import BlockHash, BlockMeta


def resolve_endpoints(extra: Mapping[str, Any], environ: Mapping[str, str] = os.environ) -> list[str]:
    """Daemon endpoints in rank order: extra config ``endpoint`` (a string, comma-separated,
    or a list), else ``KVSWAP_ENDPOINTS`` as ``kvswap launch`` sets it, else the default port.

    >>> resolve_endpoints({}, {"KVSWAP_ENDPOINTS": "tcp://h:1, tcp://h:2"})
    ['tcp://h:1', 'tcp://h:2']
    """
    given = extra.get("endpoint")
    if isinstance(given, str) and given.strip():
        return [e.strip() for e in given.split(",") if e.strip()]
    if isinstance(given, (list, tuple)) and given:
        return [str(e) for e in given]
    listed = [e.strip() for e in environ.get("KVSWAP_ENDPOINTS", "").split(",") if e.strip()]
    return listed or [DEFAULT_ENDPOINT]


def _truth(name: str, value: Any, allowed: str) -> bool | None:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    if text in ("auto", "") and "auto" in allowed:
        return None
    raise ValueError(f"kv_connector_extra_config {name} must be {allowed}, got {value!r}")


def block_meta_setting(extra: Mapping[str, Any]) -> bool | None:
    """``kv_connector_extra_config["block_meta"]``: True or False, or None for "auto" (the
    default: sent when the daemon publishes KV events, as its ``stats`` says).

    >>> block_meta_setting({}), block_meta_setting({"block_meta": "false"}), block_meta_setting({"block_meta": True})
    (None, False, True)
    """
    return _truth("block_meta", extra.get("block_meta", "auto"), "auto, true or false")


def flag_setting(extra: Mapping[str, Any], name: str, default: bool) -> bool:
    """A true/false ``kv_connector_extra_config`` key (JSON bools, or their spellings).

    >>> flag_setting({}, "load_async", True), flag_setting({"load_async": "off"}, "load_async", True)
    (True, False)
    """
    value = _truth(name, extra.get(name, default), "true or false")
    assert value is not None
    return value


def keys_for(block_hashes: Sequence[bytes], per_block: int) -> list[str]:
    """One key per engine block: the chained hash at the block's last hash boundary (it covers
    every token before it), in hex. ``per_block`` = block size / hash block size.

    >>> keys_for([b"\\x01", b"\\x02", b"\\x03", b"\\x04", b"\\x05"], 2)
    ['02', '04']
    """
    return [bytes(h).hex() for h in block_hashes[per_block - 1::per_block]]


def block_metas(block_hashes: Sequence[bytes], token_ids: Sequence[int], per_block: int, block_size: int,
                blocks: range, convert: Callable[[bytes], BlockHash], lora_name: str | None = None) -> list[BlockMeta]:
    """What kvswapd's KV events name each of ``blocks`` by, as vLLM's own BlockStored events name
    the same block: its hash (the key's: the chained hash at the block's last hash boundary,
    through ``convert``, vLLM's ``maybe_convert_block_hash``), the hash of the block before it as
    parent (None for a prompt's first block), its tokens, the engine's block size.

    >>> m = block_metas([b"\\x01", b"\\x02", b"\\x03", b"\\x04"], range(8), 2, 4, range(2), lambda h: h[0])
    >>> [(x.block_hashes, x.parent_block_hash, x.token_ids) for x in m]
    [((2,), None, (0, 1, 2, 3)), ((4,), 2, (4, 5, 6, 7))]
    """
    out = []
    parent = convert(block_hashes[blocks.start * per_block - 1]) if blocks.start > 0 else None
    for i in blocks:
        name = convert(block_hashes[(i + 1) * per_block - 1])
        out.append(BlockMeta((name,), parent, tuple(token_ids[i * block_size:(i + 1) * block_size]), block_size,
                             lora_name))
        parent = name
    return out


def loadable_blocks(num_keys: int, num_tokens: int, block_size: int) -> int:
    """Leading blocks a load may fill: full blocks only, and never the prompt's last token,
    which the engine computes to get the next token's logits.

    >>> loadable_blocks(10, 64, 32), loadable_blocks(10, 65, 32), loadable_blocks(1, 65, 32)
    (1, 2, 1)
    """
    return max(0, min(num_keys, (num_tokens - 1) // block_size))


def blocks_to_save(saved: int, computed_after: int, block_size: int, num_keys: int, num_block_ids: int) -> range:
    """Indices of the blocks a step completes, past the ``saved`` leading ones already stored:
    full blocks that are computed once the step ran and that have a key and a block id.

    >>> blocks_to_save(2, 130, 32, 10, 10)
    range(2, 4)
    """
    full = min(computed_after // block_size, num_keys, num_block_ids)
    return range(saved, max(saved, full))


class Backoff:
    """After a call fails with a retryable error (daemon down, busy, too slow), calls are
    skipped for ``retry_s``: a dead daemon costs one failed call, not one per request."""

    def __init__(self, retry_s: float, clock: Any = time.monotonic) -> None:
        self.retry_s = retry_s
        self._clock = clock
        self._until = 0.0

    @property
    def open(self) -> bool:
        return self._clock() >= self._until

    def failed(self, exc: KvswapError) -> None:
        if exc.retryable:
            self.hold()

    def hold(self) -> None:
        """Skip calls for ``retry_s`` from now, whatever the reason."""
        self._until = self._clock() + self.retry_s
