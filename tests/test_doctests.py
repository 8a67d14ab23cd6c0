"""The worked examples in docstrings (``>>>``) hold: each module's doctests run here, one test
per module, so an example that a change makes untrue fails like any other test (issue 22:
``blocks_to_save`` rounding up, saving a partly filled block, broke its own example, which
nothing ran).

The list is explicit (``--doctest-modules`` would import every module, and the vLLM
connector's need vllm and torch); a second test keeps it complete: every source file with a
``>>>`` example must be listed."""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: Modules with doctest examples, none needing vllm, torch or a GPU to import.
MODULES = (
    "kvswap.backends.remote_url",
    "kvswap.common.processes",
    "kvswap.common.units",
    "kvswap.daemon.tools.launcher",
    "kvswap.daemon.tools.status",
    "kvswap.engines.vllm.pd",
    "kvswap.engines.vllm.plan",
    "kvswap.engines.vllm.policy",
    "kvswap.engines.vllm.stats",
    "kvswap.protocol.results",
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_hold(name: str) -> None:
    module = importlib.import_module(name)
    runner_output: list[str] = []
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in finder.find(module, name):
        runner.run(test, out=runner_output.append)
    result = runner.summarize(verbose=False)
    assert result.attempted > 0, f"{name} has no doctest examples left: drop it from MODULES"
    assert result.failed == 0, "".join(runner_output)


def test_every_module_with_examples_is_listed() -> None:
    found = set()
    # Every subpackage of kvswap/: the three code folders (symlinks) and those that live there.
    for package in sorted(p for p in (ROOT / "kvswap").iterdir() if p.is_dir() and p.name != "__pycache__"):
        for path in package.rglob("*.py"):
            if ">>> " in path.read_text(encoding="utf-8"):
                found.add("kvswap." + ".".join(path.relative_to(ROOT / "kvswap").with_suffix("").parts))
    assert found, "no module with doctest examples found: the scan is broken"
    assert sorted(found - set(MODULES)) == [], "modules with >>> examples that no test runs"
    assert sorted(set(MODULES) - found) == [], "listed modules without >>> examples"
