"""The CuPy mover's copy kernel compiles: NVRTC (which needs no GPU) turns its source into PTX
for the architectures the daemon runs on, with the 16-byte vector path intact. Skipped where
libnvrtc is not installed (``pip install nvidia-cuda-nvrtc-cu12`` brings it)."""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import importlib.util
import os

import pytest

from kvswap.daemon.movers.kernels import CHUNK_KERNEL_NAME, CHUNK_KERNEL_SOURCE


def load_nvrtc():
    candidates = []
    spec = importlib.util.find_spec("nvidia.cuda_nvrtc") if importlib.util.find_spec("nvidia") else None
    for root in (spec.submodule_search_locations or []) if spec else []:
        candidates += sorted(glob.glob(os.path.join(root, "lib", "libnvrtc.so*")))
    found = ctypes.util.find_library("nvrtc")
    if found:
        candidates.append(found)
    for path in candidates:
        if "builtins" in path or ".alt." in path:
            continue
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


NVRTC = load_nvrtc()
pytestmark = pytest.mark.skipif(NVRTC is None, reason="libnvrtc is not installed")


def compile_ptx(source: str, arch: str) -> tuple[int, str, str]:
    prog = ctypes.c_void_p()
    assert NVRTC.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"kvswap_copy.cu", 0, None, None) == 0
    try:
        options = (ctypes.c_char_p * 1)(f"--gpu-architecture={arch}".encode())
        result = NVRTC.nvrtcCompileProgram(prog, 1, options)
        size = ctypes.c_size_t()
        NVRTC.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        NVRTC.nvrtcGetProgramLog(prog, log)
        ptx = ""
        if result == 0:
            NVRTC.nvrtcGetPTXSize(prog, ctypes.byref(size))
            buf = ctypes.create_string_buffer(size.value)
            NVRTC.nvrtcGetPTX(prog, buf)
            ptx = buf.value.decode()
        return result, log.value.decode(errors="replace"), ptx
    finally:
        NVRTC.nvrtcDestroyProgram(ctypes.byref(prog))


@pytest.mark.parametrize("arch", ["compute_70", "compute_80", "compute_90"])
def test_copy_kernel_compiles_with_its_vector_path(arch):
    result, log, ptx = compile_ptx(CHUNK_KERNEL_SOURCE, arch)
    assert result == 0, log
    assert f".entry {CHUNK_KERNEL_NAME}(" in ptx
    assert "ld.global.nc.v4.u32" in ptx and "st.v4.u32" in ptx  # the 16-byte copies
    assert "ld.global.nc.u32" in ptx and "ld.u8" in ptx          # the 4-byte and byte fallbacks


def test_a_broken_kernel_is_reported():
    result, log, _ = compile_ptx(CHUNK_KERNEL_SOURCE.replace("uint4", "uint_four"), "compute_80")
    assert result != 0 and "uint_four" in log
