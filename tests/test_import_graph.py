"""The project's modules import each other without a cycle (issue 11: remote.py and the
Redis/Mooncake adapters imported each other).

Every ``import`` and ``from ... import`` statement of every module of the package (daemon/,
backends/ and protocol/ at the top, the packages that live inside kvswap/) is read with
``ast`` — at any depth, so an import inside a function (the way the old loop hid) counts as
much as one at the top; only ``if TYPE_CHECKING:`` blocks are left out,
since they never run. Relative imports are resolved against the importing module's package.
``from package import name`` is an edge to ``package.name`` when that is a module of ours,
else to the package itself. Python's implicit import of parent packages is not an edge: a
module importing a sibling by its absolute name is not a cycle through ``__init__``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: Folder (from the repository root) -> the package it is. The three code folders sit at the top
#: (DESIGN.md; kvswap/ links to them); the packages of issue 23 are directories inside kvswap/.
PACKAGES = {
    "daemon": "kvswap.daemon",
    "backends": "kvswap.backends",
    "protocol": "kvswap.protocol",
    "kvswap/common": "kvswap.common",
    "kvswap/engines": "kvswap.engines",
    "kvswap/testing": "kvswap.testing",
}

#: What each package must not import: DESIGN.md's layout table, and issue 23's one owner per
#: job. common is the bottom: the low-level code both sides share (errors, units, shared memory,
#: the CUDA driver, processes). protocol is the wire protocol an engine imports; engines the
#: adapters inside an engine; testing (helpers of the tests and benchmarks) is imported by
#: nothing of the package.
FORBIDDEN = {
    "kvswap.common": ("kvswap.protocol", "kvswap.engines", "kvswap.backends", "kvswap.daemon", "kvswap.testing"),
    "kvswap.protocol": ("kvswap.engines", "kvswap.backends", "kvswap.daemon", "kvswap.testing"),
    "kvswap.engines": ("kvswap.backends", "kvswap.daemon", "kvswap.testing"),
    "kvswap.backends": ("kvswap.engines", "kvswap.daemon", "kvswap.testing"),
    "kvswap.daemon": ("kvswap.engines", "kvswap.testing"),
}

#: The one exception: modules left at an old path for a release, each importing only from its
#: new place (protocol/engines/vllm_connector.py: vLLM configs name that path; goes in 0.2.0).
SHIMS = {"kvswap.protocol.engines.vllm_connector": "kvswap.engines.vllm.connector"}


def module_files(root: Path) -> dict[str, Path]:
    """``kvswap.<package>.<...>`` -> file, for every .py file of the packages above."""
    modules = {}
    for folder, package in PACKAGES.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = [*package.split("."), *path.relative_to(root / folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST):
    """Import statements anywhere in the tree except under ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules ``name`` (stored at ``path``) imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                       for alias in node.names]
        for target in targets:
            # ``import kvswap.a.b`` names module kvswap.a.b; fall back to its longest known prefix.
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    modules = module_files(root)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as ``[a, b, ..., a]``, or None. Iterative DFS, deterministic order."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if state.get(start):
            continue
        path = [start]
        state[start] = 1
        iters = [iter(sorted(graph[start]))]
        while iters:
            nxt = next(iters[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                iters.pop()
                continue
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                iters.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_the_project_has_no_import_cycle():
    graph = import_graph(ROOT)
    assert len(graph) > 40 and "kvswap.backends.remote" in graph  # the walk found the modules
    assert "kvswap.engines.vllm.connector" in graph
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_every_package_of_the_layout_table_is_walked():
    graph = import_graph(ROOT)
    for package in PACKAGES.values():
        assert any(within(name, package) for name in graph), f"no module of {package} found"


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_each_package_imports_only_what_its_layer_may(package):
    """protocol imports nothing of daemon or backends (an engine imports protocol alone), nor the
    engines; engines nothing of daemon or backends; common nothing of the rest of the package."""
    graph = import_graph(ROOT)
    for name, targets in graph.items():
        if within(name, package):
            allowed = {SHIMS[name]} if name in SHIMS else set()
            bad = sorted(t for t in targets - allowed if any(within(t, f) for f in FORBIDDEN[package]))
            assert not bad, f"{name} imports {bad}"


@pytest.mark.parametrize("shim, target", sorted(SHIMS.items()))
def test_a_shim_imports_only_its_new_place_and_names_it_defines(shim, target):
    """A shim left at an old path re-exports what its new module defines, and nothing else of ours."""
    modules = module_files(ROOT)
    assert import_graph(ROOT)[shim] == {target}
    defined = {node.name for node in ast.parse(modules[target].read_text()).body
               if isinstance(node, (ast.ClassDef, ast.FunctionDef))}
    imported = {alias.asname or alias.name for node in ast.parse(modules[shim].read_text()).body
                if isinstance(node, ast.ImportFrom) and node.module == target for alias in node.names}
    assert imported and imported <= defined, f"{shim} re-exports {sorted(imported - defined)} that {target} lacks"


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_planted_loop_is_found_and_named(tmp_path):
    """The shape of the old loop: a module that imports an adapter inside a function, and the
    adapter importing the module back at the top, through a relative import."""
    _write(tmp_path, {
        "protocol/__init__.py": "", "daemon/__init__.py": "",
        "backends/__init__.py": "",
        "backends/base.py": "X = 1\n",
        "backends/remote.py": "from .base import X\n\ndef open_remote():\n    from .redis_tier import R\n    return R\n",
        "backends/redis_tier.py": "from .remote import open_remote\nfrom kvswap.backends import base\nR = 1\n",
    })
    cycle = find_cycle(import_graph(tmp_path))
    assert cycle is not None and set(cycle) == {"kvswap.backends.remote", "kvswap.backends.redis_tier"}
    assert cycle[0] == cycle[-1] and len(cycle) == 3


def test_type_checking_imports_and_sibling_absolute_imports_are_no_loop(tmp_path):
    _write(tmp_path, {
        "protocol/__init__.py": "from .client import C\n",
        "protocol/client.py": "from kvswap.protocol.errors import E\nC = 1\n",
        "protocol/errors.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .client import C\nE = 1\n",
        "daemon/__init__.py": "", "backends/__init__.py": "",
    })
    graph = import_graph(tmp_path)
    assert graph["kvswap.protocol"] == {"kvswap.protocol.client"}
    assert graph["kvswap.protocol.client"] == {"kvswap.protocol.errors"}
    assert find_cycle(graph) is None


@pytest.mark.parametrize("statement, target", [
    ("from ..staging import slot_bytes_for", "kvswap.daemon.staging"),
    ("from .. import staging", "kvswap.daemon.staging"),
    ("import kvswap.daemon.staging as s", "kvswap.daemon.staging"),
    ("from kvswap.daemon import tools", "kvswap.daemon.tools"),
    ("from kvswap.daemon.tools import SOMETHING", "kvswap.daemon.tools"),
])
def test_relative_and_absolute_imports_resolve(tmp_path, statement, target):
    _write(tmp_path, {
        "daemon/__init__.py": "", "daemon/staging.py": "", "daemon/tools/__init__.py": "",
        "daemon/tools/bench.py": f"def f():\n    {statement}\n",
        "backends/__init__.py": "", "protocol/__init__.py": "",
    })
    assert import_graph(tmp_path)["kvswap.daemon.tools.bench"] == {target} - {"kvswap.daemon.tools.bench"}
