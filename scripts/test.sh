#!/usr/bin/env bash
# The one command for the tests, and what CI runs (.ci/run calls it with CI=true):
#
#   1. a virtualenv ($KVSWAP_TEST_VENV, default .venv) with kvswap and its test extra;
#   2. the system packages the tests start or load, from apt where missing: redis-server (the
#      Redis tier tests), libibverbs1 (Mooncake's client library links it even for TCP),
#      prometheus (promtool and prometheus, for the deploy tests) and systemd (systemd-analyze);
#   3. mypy over the whole package (settings in pyproject.toml, [tool.mypy]): a type error
#      fails the run before any test;
#   4. pytest, with any arguments given here (scripts/test.sh tests/test_record.py -x).
#
# A component that is still missing after step 2 stops the run with its name: its tests would
# only skip, and a green run would hide that. A contributor without root may accept the skips
# with KVSWAP_TEST_ALLOW_SKIPS=1 (never under CI=true); pytest then lists them by reason.
set -euo pipefail
cd "$(dirname "$0")/.."

venv="${KVSWAP_TEST_VENV:-.venv}"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
# shellcheck disable=SC1091
. "$venv/bin/activate"
python -m pip install --quiet --upgrade pip
python -m pip install --quiet -e '.[test]'

has_redis() { command -v redis-server >/dev/null 2>&1; }
has_ibverbs() { ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 '; }
has_prometheus() { command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1; }
has_systemd_analyze() { command -v systemd-analyze >/dev/null 2>&1; }

missing() {
    local out=()
    has_redis || out+=(redis-server)
    has_ibverbs || out+=(libibverbs1)
    has_prometheus || out+=(prometheus)
    has_systemd_analyze || out+=(systemd)
    echo "${out[@]:-}"
}

wanted="$(missing)"
if [ -n "$wanted" ] && command -v apt-get >/dev/null 2>&1; then
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo -n"
    # apt may be slow or locked by another job: retry downloads and wait for the lock.
    apt_opts=(-o Acquire::Retries=5 -o Acquire::http::Timeout=60 -o DPkg::Lock::Timeout=300)
    echo "installing $wanted (apt)" >&2
    # shellcheck disable=SC2086
    if ! { timeout 900 $sudo apt-get "${apt_opts[@]}" update -qq &&
           timeout 1200 $sudo env DEBIAN_FRONTEND=noninteractive apt-get "${apt_opts[@]}" install -y -qq \
               --no-install-recommends $wanted; } >/dev/null; then
        echo "apt-get could not install: $wanted" >&2
    fi
fi

still="$(missing)"
if [ -n "$still" ]; then
    if [ "${KVSWAP_TEST_ALLOW_SKIPS:-0}" = 1 ] && [ "${CI:-}" != true ]; then
        echo "warning: missing $still; the tests that need them will skip (listed at the end)" >&2
    else
        echo "error: missing $still, which the tests need; install them (Debian package names) or, outside CI," \
             "set KVSWAP_TEST_ALLOW_SKIPS=1 to run without their tests" >&2
        exit 1
    fi
fi

python -m mypy
exec python -m pytest -q "$@"
