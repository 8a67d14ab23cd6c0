"""The native copy helper (daemon/movers/_fastcopy.c): it copies exactly what a table says, a
fault inside a copy comes back as the faulting row, and a fault anywhere else still kills the
process (the guard never swallows a real crash). Faults are made the way an engine makes them:
a real shared-memory file truncated under a real mapping."""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest
from copy_paths import copy_path, require_native  # noqa: F401 (copy_path is a fixture)
from hypothesis import given, settings
from hypothesis import strategies as st

from kvswap.common.shm import SharedSegment
from kvswap.daemon.movers.native import load_copy_rows
from kvswap.daemon.movers.segment import SegmentShrunk
from kvswap.daemon.registration import Registration
from kvswap.protocol import CacheLayout, HostKVCache


@pytest.fixture(scope="module")
def copy_rows():
    require_native()
    return load_copy_rows(True)


def table(rows: list[tuple[int, int, int]]) -> np.ndarray:
    return np.array(rows, dtype=np.uint64).reshape(-1, 3)


class Truncatable:
    """A shared-memory file of ``size`` bytes mapped whole, which the test can truncate."""

    def __init__(self, size: int) -> None:
        self.segment = SharedSegment.create(size, prefix="kvswap-test")
        self.fd = os.open(f"/dev/shm/{self.segment.name}", os.O_RDWR)
        self.mapping = mmap.mmap(self.fd, size)
        self.view = np.frombuffer(self.mapping, dtype=np.uint8)
        self.view[:] = np.arange(size, dtype=np.uint64).astype(np.uint8)
        self.addr = self.view.ctypes.data

    def truncate(self, size: int) -> None:
        os.ftruncate(self.fd, size)

    def close(self) -> None:
        del self.view
        self.mapping.close()
        os.close(self.fd)
        self.segment.close()
        self.segment.unlink()


#: Rows this long take the helper's streaming-store path (STREAM_MIN_BYTES in _fastcopy.c).
STREAM_MIN = 16 * 1024


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_copy_rows_matches_numpy_slicing(copy_rows, data) -> None:
    """Random tables, rows applied in order (later rows overwrite earlier ones, as slicing
    does), zero-length rows, odd offsets and rows on both sides of the streaming threshold."""
    n_src = data.draw(st.integers(1, 3 * STREAM_MIN), label="source bytes")
    n_dst = data.draw(st.integers(1, 3 * STREAM_MIN), label="destination bytes")
    seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
    src = np.random.default_rng(seed).integers(0, 256, n_src, dtype=np.uint8)
    dst = np.zeros(n_dst, np.uint8)
    want = dst.copy()
    rows = []
    for _ in range(data.draw(st.integers(0, 12), label="rows")):
        most = min(n_src, n_dst)
        nbytes = data.draw(st.one_of(st.integers(0, min(most, 300)),
                                     st.integers(min(most, STREAM_MIN - 70), most)), label="nbytes")
        s = data.draw(st.integers(0, n_src - nbytes))
        d = data.draw(st.integers(0, n_dst - nbytes))
        rows.append((src.ctypes.data + s, dst.ctypes.data + d, nbytes))
        want[d:d + nbytes] = src[s:s + nbytes]
    assert copy_rows(table(rows)) == len(rows)
    assert dst.tobytes() == want.tobytes()
    assert copy_rows(np.zeros((0, 3), np.uint64)) == 0


def test_copy_rows_refuses_a_table_that_is_not_rows(copy_rows) -> None:
    with pytest.raises(ValueError):
        copy_rows(np.zeros(4, np.uint64))  # not a whole number of rows
    with pytest.raises(TypeError):
        copy_rows("not a buffer")


@pytest.mark.parametrize("flag_row", range(5))
def test_copy_rows_reads_the_stop_flag_before_every_row(copy_rows, flag_row: int) -> None:
    """Row ``flag_row`` itself raises the stop flag (it copies a 1 into it), as the loop raises
    it at a deadline while the batch runs: that row ends, and no later row is started."""
    src = np.arange(1, 5 * 64 + 1, dtype=np.uint64).astype(np.uint8)
    dst = np.zeros(5 * 64, np.uint8)
    stop, one = np.zeros(1, np.uint32), np.ones(1, np.uint32)
    rows = [(src.ctypes.data + 64 * i, dst.ctypes.data + 64 * i, 64) for i in range(5)]
    rows.insert(flag_row + 1, (one.ctypes.data, stop.ctypes.data, 4))
    assert copy_rows(table(rows), stop) == flag_row + 2  # the rows before, and the flag's own
    assert stop[0] == 1
    assert dst[:64 * (flag_row + 1)].tobytes() == src[:64 * (flag_row + 1)].tobytes()
    assert not dst[64 * (flag_row + 1):].any()
    # Raised before the call: nothing is copied; without a flag, every row is.
    assert copy_rows(table(rows), stop) == 0
    assert copy_rows(table(rows)) == len(rows)


def test_a_long_row_stops_within_a_mebibyte(copy_rows) -> None:
    """A 4 MiB row is copied a MiB at a time with the flag read between pieces, so a stop waits
    for one piece, not the row. The flag lives inside the destination, 1.5 MiB in, so the
    second piece raises it."""
    mib = 1 << 20
    src = np.full(4 * mib, 7, np.uint8)
    dst = np.zeros(4 * mib, np.uint8)
    stop = dst[mib + mib // 2:mib + mib // 2 + 4].view(np.uint32)
    assert copy_rows(table([(src.ctypes.data, dst.ctypes.data, 4 * mib)]), stop) == 0  # not whole
    assert (dst[:2 * mib] == 7).all()
    assert not dst[2 * mib:].any()


def test_copy_rows_refuses_a_stop_flag_it_cannot_read(copy_rows) -> None:
    rows = table([(0, 0, 0)])
    with pytest.raises(ValueError):
        copy_rows(rows, np.zeros(2, np.uint8))  # shorter than a uint32
    with pytest.raises(ValueError):
        copy_rows(rows, np.zeros(8, np.uint8)[1:5])  # not aligned
    with pytest.raises(TypeError):
        copy_rows(rows, "not a buffer")


def test_a_helper_built_without_the_stop_flag_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stale build (an install not rebuilt since the flag came) would ignore it: use preadv."""
    require_native()
    from kvswap.daemon.movers import _fastcopy
    monkeypatch.delattr(_fastcopy, "API_VERSION")
    assert load_copy_rows(True) is None


def test_a_fault_inside_a_copy_is_the_faulting_row(copy_rows) -> None:
    shm = Truncatable(64 * 4096)
    try:
        out = np.zeros(3 * 4096, np.uint8)
        rows = table([(shm.addr, out.ctypes.data, 4096),                        # page 0: survives
                      (shm.addr + 40 * 4096, out.ctypes.data + 4096, 4096),     # past the new end
                      (shm.addr + 4096, out.ctypes.data + 8192, 4096)])          # never reached
        expected_first = shm.view[:4096].tobytes()
        shm.truncate(8 * 4096)
        assert copy_rows(rows) == -2
        assert out[:4096].tobytes() == expected_first
        assert not out[8192:].any()
        # Writing into the truncated part faults the same way, and the guard is ready again.
        assert copy_rows(table([(out.ctypes.data, shm.addr + 9 * 4096, 16)])) == -1
        assert copy_rows(table([(shm.addr, out.ctypes.data, 3 * 4096)])) == 1  # inside the new end: fine
    finally:
        shm.close()


#: A child that arms the guard (a fault inside it is caught), then faults outside it.
CHILD = r"""
import mmap, os, sys
import numpy as np
from kvswap.daemon.movers._fastcopy import copy_rows
how = sys.argv[1]
fd = os.memfd_create("kvswap-fault")
os.ftruncate(fd, 1 << 20)
m = mmap.mmap(fd, 1 << 20)
v = np.frombuffer(m, np.uint8)
os.ftruncate(fd, 4096)
out = np.zeros(16, np.uint8)
got = copy_rows(np.array([[v.ctypes.data + 8192, out.ctypes.data, 16]], np.uint64))
print("guarded", got, flush=True)
if how == "bus":
    print(int(v[1 << 19]))        # a read past the end through numpy: SIGBUS outside the guard
elif how == "segv":
    import ctypes
    ctypes.string_at(8)           # a null-page read: SIGSEGV outside the guard
else:
    os.kill(os.getpid(), int(how))  # sent, not a fault: must still kill
print("survived", flush=True)
"""


@pytest.mark.parametrize("how, sig, faulthandler", [
    ("bus", signal.SIGBUS, False), ("segv", signal.SIGSEGV, False), ("bus", signal.SIGBUS, True),
    (str(int(signal.SIGSEGV)), signal.SIGSEGV, False),
])
def test_a_fault_outside_the_guard_still_kills(copy_rows, how: str, sig: int, faulthandler: bool) -> None:
    """The handler chains: without faulthandler the default action kills the process with the
    signal; with faulthandler installed before the helper, it still prints its traceback."""
    args = [sys.executable, *(["-X", "faulthandler"] if faulthandler else []), "-c", CHILD, how]
    proc = subprocess.run(args, check=False, capture_output=True, text=True, timeout=60)
    assert proc.stdout.splitlines()[0] == "guarded -1", proc.stderr
    assert "survived" not in proc.stdout
    assert proc.returncode == -sig, (proc.returncode, proc.stderr)
    if faulthandler:
        assert "Fatal Python error: Bus error" in proc.stderr


#: A child that imports the helper, then lets another handler replace its guard (as paddle
#: does at import, and as Python's signal.signal does), then copies over a truncated page.
REPLACED = r"""
import mmap, os, signal
import numpy as np
from kvswap.daemon.movers._fastcopy import copy_rows
seen = []
signal.signal(signal.SIGBUS, lambda signum, frame: seen.append(signum))   # replaces the guard
fd = os.memfd_create("kvswap-fault")
os.ftruncate(fd, 1 << 20)
m = mmap.mmap(fd, 1 << 20)
v = np.frombuffer(m, np.uint8)
os.ftruncate(fd, 4096)
out = np.zeros(16, np.uint8)
for _ in range(2):
    print("guarded", copy_rows(np.array([[v.ctypes.data + 8192, out.ctypes.data, 16]], np.uint64)), flush=True)
os.kill(os.getpid(), signal.SIGBUS)   # not a copy's fault: it reaches the handler set after us
print("python handler saw", seen, flush=True)
"""


def test_a_handler_installed_after_the_helper_does_not_break_the_guard(copy_rows) -> None:
    """Before the fix the guarded fault went to the newer handler: paddle's aborts the process,
    Python's returns into the same fault forever (this child then times out)."""
    proc = subprocess.run([sys.executable, "-c", REPLACED], check=False, capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["guarded -1", "guarded -1",
                                        f"python handler saw [{int(signal.SIGBUS)}]"], proc.stdout


def test_a_truncate_racing_native_copies_is_a_typed_error(copy_path: str) -> None:  # noqa: F811
    """Gathers and scatters through a SegmentMover while the segment is truncated in the middle
    of a batch, after its size was checked: at a fixed point per round (the mover asks ``live``
    before each block's rows on the native path and before each region's chunk on the preadv
    path, and this ``live`` truncates on its ``cut``-th call). Every round raises SegmentShrunk,
    the blocks copied before the cut hold the right bytes, and the process stays alive."""
    layout = CacheLayout("race", num_layers=4, num_blocks=256, block_size=8, num_kv_heads=2, head_dim=32,
                         dtype="float16")
    regions = len(layout.regions)
    with HostKVCache.create(layout) as cache:
        path = f"/dev/shm/{cache.segment.name}"
        full = cache.segment.size
        for rnd in range(12):
            os.truncate(path, full)
            cache.fill_random(rnd)
            expected = [cache.block_record(b) for b in range(64)]
            body = cache.registration()
            registration = Registration.attach(body["layout"], body["handles"], body["regions"], body["pid"])
            mover = registration.mover
            assert mover.describe()["copy"] == copy_path
            slots = [np.zeros(layout.record_bytes, np.uint8) for _ in range(64)]
            cut, calls = 1 + rnd * 5, [0]

            def live() -> bool:
                calls[0] += 1
                if calls[0] == cut:
                    os.truncate(path, full // 3 if rnd % 2 else 0)
                return True

            gather = rnd % 4 < 2
            try:
                with pytest.raises(SegmentShrunk) as raised:
                    for start in range(0, 256, 64):
                        blocks = list(range(start, start + 64))
                        (mover.gather_blocks if gather else mover.scatter_blocks)(blocks, slots, live)
                assert raised.value.details["reason"] == "segment_shrunk"
                if gather:
                    whole = (cut - 1) if copy_path == "native" else (cut - 1) // regions
                    assert [s.tobytes() for s in slots[:whole]] == expected[:whole]
            finally:
                registration.close()
