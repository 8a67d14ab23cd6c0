"""docs/integration.md's code is real: its key function and its worker class run against a
live daemon, and what they load is byte-identical to what they wrote back."""

from __future__ import annotations

import re
from pathlib import Path

from kvswap.protocol import CacheLayout, HostKVCache

from support import DaemonProcess

DOC = Path(__file__).resolve().parent.parent / "docs" / "integration.md"


def doc_code(containing: str) -> dict:
    blocks = re.findall(r"^```python\n(.*?)^```", DOC.read_text(), flags=re.S | re.M)
    [block] = [b for b in blocks if containing in b]
    namespace: dict = {}
    exec(compile(block, f"{DOC}:{containing}", "exec"), namespace)  # the doc's own code, as written
    return namespace


def test_block_keys_form_a_prefix_chain() -> None:
    block_keys = doc_code("def block_keys")["block_keys"]
    a = block_keys(list(range(20)), 8)
    b = block_keys(list(range(16)) + [99] * 8, 8)
    assert len(a) == 2 and len(b) == 3  # full blocks only
    assert a == b[:2]  # same prefix, same keys
    assert block_keys(list(range(20)), 8, extra=b"lora-7")[0] != a[0]
    assert all(re.fullmatch(r"[0-9a-f]{64}", k) for k in b)


def test_the_worker_example_writes_back_and_loads_prefixes(daemon: DaemonProcess, layout: CacheLayout) -> None:
    block_keys = doc_code("def block_keys")["block_keys"]
    KVOffload = doc_code("class KVOffload")["KVOffload"]
    prompt = list(range(1000, 1000 + 5 * layout.block_size))
    keys = block_keys(prompt, layout.block_size)
    with HostKVCache.create(layout) as cache:
        cache.fill_random(seed=11)
        worker = KVOffload(daemon.endpoint, cache)
        try:
            expected = [cache.block_record(b) for b in (0, 1, 2)]
            assert worker.write_back([0, 1, 2], keys[:3]) == 3
            assert worker.write_back([0, 1, 2], keys[:3]) == 3  # again: all "exists"

            free = iter(range(20, 32))
            loaded, blocks = worker.load_prefix(keys, lambda n: [next(free) for _ in range(n)])
            assert (loaded, blocks) == (3, [20, 21, 22])
            assert [cache.block_record(b) for b in blocks] == expected

            # The daemon forgets the registration (as after a restart): the worker re-registers.
            worker.kv.unregister()
            loaded, blocks = worker.load_prefix(keys[:2], lambda n: list(range(n)))
            assert loaded == 2 and [cache.block_record(b) for b in blocks] == expected[:2]
        finally:
            worker.kv.close()
