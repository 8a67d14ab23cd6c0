"""Fixtures: a real kvswapd subprocess on loopback with a real directory, and an engine-side
cache in shared memory."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path
from typing import Iterator

import pytest


class _MutatedCopies:
    """Under mutmut (docs/testing.md) these tests run from a copy of the repository in
    ``mutants/``, whose ``backends/``, ``daemon/`` and ``protocol/`` hold the mutated code. The
    editable install maps ``kvswap.*`` to the real folders, so this finder, put first, loads
    ``kvswap.backends``, ``kvswap.daemon`` and ``kvswap.protocol`` (and everything under them)
    from the copies. mutmut names a mutant by its file's path (``backends.record``), so each
    module (not package) runs its body under that short name (functions keep it as
    ``__module__``) and is registered under it too."""

    FOLDERS = {"kvswap.protocol": "protocol", "kvswap.backends": "backends", "kvswap.daemon": "daemon"}

    def __init__(self, root: Path) -> None:
        self.root = root

    def find_spec(self, fullname: str, path: object = None, target: object = None):
        top = next((p for p in self.FOLDERS if fullname == p or fullname.startswith(p + ".")), None)
        if top is None:
            return None
        rel = Path(self.FOLDERS[top], *fullname[len(top) + 1:].split(".")) if fullname != top \
            else Path(self.FOLDERS[top])
        where = self.root / rel
        if (where / "__init__.py").exists():
            return importlib.util.spec_from_file_location(
                fullname, where / "__init__.py", loader=_ShortNameLoader(fullname, str(where / "__init__.py")),
                submodule_search_locations=[str(where)])
        if where.with_suffix(".py").exists():
            file = str(where.with_suffix(".py"))
            return importlib.util.spec_from_file_location(fullname, file, loader=_ShortNameLoader(fullname, file))
        return None


class _ShortNameLoader(importlib.machinery.SourceFileLoader):
    def exec_module(self, module) -> None:
        full = module.__name__
        code = self.get_code(full)
        if self.is_package(full):  # ``from . import x`` in an __init__ goes by the package's name
            exec(code, module.__dict__)
            return
        short = full.removeprefix("kvswap.")
        sys.modules[short] = module
        module.__name__ = short
        try:
            exec(code, module.__dict__)
        finally:
            module.__name__ = full


def _import_mutated_copies() -> None:
    root = Path(__file__).resolve().parent.parent
    if root.name == "mutants" and "kvswap.protocol" not in sys.modules:
        sys.meta_path.insert(0, _MutatedCopies(root))


_import_mutated_copies()

from kvswap.protocol import CacheLayout, Client, HostKVCache  # noqa: E402 (after the mutmut hook)
from support import DaemonProcess, free_port  # noqa: E402

#: Under CI=true, a skip for a component the test set-up installs fails the run.
pytest_plugins = ["ci_skips"]


@pytest.fixture
def storage_dir(tmp_path: Path) -> Path:
    return tmp_path / "store"


@pytest.fixture
def daemon(storage_dir: Path) -> Iterator[DaemonProcess]:
    d = DaemonProcess(storage_dir, free_port(), free_port()).start()
    yield d
    code = d.stop()
    assert code == 0, f"kvswapd exited with {code}:\n{d.log()}"


@pytest.fixture
def layout() -> CacheLayout:
    return CacheLayout("test-model", num_layers=3, num_blocks=32, block_size=8, num_kv_heads=2, head_dim=16)


@pytest.fixture
def cache(layout: CacheLayout) -> Iterator[HostKVCache]:
    with HostKVCache.create(layout) as c:
        c.fill_random(seed=1)
        yield c


@pytest.fixture
def client(daemon: DaemonProcess) -> Iterator[Client]:
    with Client(daemon.endpoint, timeout=10) as c:
        yield c
