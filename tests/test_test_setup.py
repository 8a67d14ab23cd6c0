"""The test set-up itself: under CI=true a skip for a component the set-up installs fails the
run (tests/ci_skips.py), other skips stay skips, and every skip is listed by reason. Runs
pytest in a subprocess on a small test file, with this folder's plugin."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from support import INSTALLED_BY_TEST_SETUP

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent

SAMPLE = f"""
import pytest

def test_needs_redis():
    pytest.skip("redis-server is not installed (Debian package redis-server; {INSTALLED_BY_TEST_SETUP})")

@pytest.mark.skipif(True, reason="no CUDA device here")
def test_needs_a_gpu():
    pass

def test_runs():
    assert True
"""


def run_sample(tmp_path: Path, ci: str | None) -> subprocess.CompletedProcess:
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    # The repository's pytest settings (-rs among them), this folder's plugin, the sample file.
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "ci_skips", "-p", "no:cacheprovider",
                           "-c", str(REPO / "pyproject.toml"), "--rootdir", str(tmp_path), str(tmp_path)],
                          capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)


def test_outside_ci_a_missing_component_is_a_skip_listed_by_reason(tmp_path: Path) -> None:
    r = run_sample(tmp_path, ci=None)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 passed, 2 skipped" in r.stdout
    assert "SKIPPED [1] test_sample.py:5: redis-server is not installed" in r.stdout
    assert "SKIPPED [1] test_sample.py:7: no CUDA device here" in r.stdout


def test_on_ci_a_missing_component_fails_and_a_missing_gpu_still_skips(tmp_path: Path) -> None:
    r = run_sample(tmp_path, ci="true")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "1 failed, 1 passed, 1 skipped" in r.stdout
    assert "CI=true, and this test would skip: Skipped: redis-server is not installed" in r.stdout
    assert "SKIPPED [1] test_sample.py:7: no CUDA device here" in r.stdout


def test_the_ci_script_runs_the_one_test_command() -> None:
    """.ci/run is the one command with CI=true, and the README gives that same command."""
    ci = (REPO / ".ci" / "run").read_text()
    assert "export CI=true" in ci and "scripts/test.sh" in ci
    script = REPO / "scripts" / "test.sh"
    assert os.access(script, os.X_OK)
    text = script.read_text()
    for package in ("redis-server", "libibverbs1", "prometheus", "systemd"):
        assert package in text
    assert "pip install --quiet -e '.[test]'" in text
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True, timeout=30).returncode == 0
    assert "scripts/test.sh" in (REPO / "README.md").read_text()
