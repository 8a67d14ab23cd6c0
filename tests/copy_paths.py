"""The shared-memory mover's two copy paths as a pytest parameter, so tests that move bytes
through a SegmentMover run once on the native helper and once on the preadv fallback (CI tests
both). Use it by naming ``copy_path`` before ``daemon``: the daemon inherits the variable."""

from __future__ import annotations

import shutil
import sysconfig
from pathlib import Path

import pytest

from kvswap.daemon.movers.native import ENV_VAR, load_copy_rows

PATHS = ("native", "preadv")


def require_native() -> None:
    """Skip where the helper cannot have been built (no compiler or no Python headers); fail
    where it could and was not, so an install that silently fell back is seen."""
    if load_copy_rows(True) is not None:
        return
    headers = Path(sysconfig.get_paths()["include"], "Python.h").exists()
    if headers and (shutil.which("cc") or shutil.which("gcc")):
        pytest.fail("a C compiler and Python headers are present but kvswap.daemon.movers._fastcopy is not "
                    "built: reinstall with pip install -e .")
    pytest.skip("the native copy helper is not built here (no C compiler or Python headers at install)")


@pytest.fixture(params=PATHS)
def copy_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "native":
        require_native()
    monkeypatch.setenv(ENV_VAR, "1" if request.param == "native" else "0")
    return request.param
