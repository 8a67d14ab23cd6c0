"""Attaching a ``cuda_ipc`` registration: open the engine's handles, choose a GPU framework
(paddle or CuPy) to run the kernels and build the :class:`~.device.DeviceMover` over them.

Naming: inside the movers a GPU framework is a *framework* ("backend" means a storage tier
everywhere else). The operator-facing names keep the word for compatibility: the environment
variable ``KVSWAP_GPU_BACKEND`` and ``Registration.attach(gpu_backend=...)``."""

import contextlib
import ctypes
import importlib
import importlib.util
import logging
import os
import signal
from typing import Any, Final, Sequence

import numpy as np

from kvswap.common.cuda_driver import CudaDriver, CudaError
from kvswap.protocol.errors import InvalidLayout
from kvswap.protocol.layout import CacheLayout

from .copiers import CudaCopier
from .copy_plan import Placement
from .cuda import IPC_MAPPINGS, CudaDevice, find_ordinal
from .device import DEFAULT_DEVICE_STAGING_BYTES, DeviceMover, Kernels
from .gpu_plan import (
    check_fits,
    parse_cuda_handles,
    records_per_batch,
)
from .kernels import ChunkKernels, CupyChunkRunner, PaddleKernels

log = logging.getLogger(__name__)

#: GPU frameworks a mover can run its kernels on, in the order ``auto`` tries them.
FRAMEWORKS: Final = ("paddle", "cupy")

# -- attaching a cuda_ipc registration -----------------------------------------------------------


def _import(name: str) -> Any:
    return importlib.import_module(name)


#: Signals the daemon handles itself (SIGTERM drains); paddle must not take them over.
_DAEMON_SIGNALS: Final = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")


@contextlib.contextmanager
def keep_signal_handlers():
    """Put the process's signal handlers back as they were after the block.

    Paddle installs C++ handlers for SIGTERM and others when it loads (they print a stack and
    abort: "FatalError: `Termination signal` is detected"), which would turn the daemon's
    SIGTERM drain into a crash. ``signal.signal`` cannot undo that from the copy thread this
    runs on, so the C-level actions are saved and restored with ``sigaction`` (process-wide,
    any thread); the buffer is opaque to us and only passed back to libc.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    saved = []
    for name in _DAEMON_SIGNALS:
        number = int(getattr(signal, name))
        action = ctypes.create_string_buffer(512)  # larger than any libc's struct sigaction
        if libc.sigaction(number, None, action) == 0:
            saved.append((number, action))
    try:
        yield
    finally:
        for number, action in saved:
            if libc.sigaction(number, action, None) != 0:
                log.warning("could not restore the handler of signal %d", number)


def import_paddle() -> Any:
    """Import paddle without letting it take the daemon's signals."""
    with keep_signal_handlers():
        paddle = _import("paddle")
        paddle.to_tensor([0])  # the first op finishes paddle's own initialisation
    return paddle


def framework_order(requested: str | None) -> list[str]:
    """Which frameworks to try: the one asked for (``KVSWAP_GPU_BACKEND`` where none is; the
    variable keeps its old name for compatibility), or paddle then CuPy for ``auto``."""
    choice = (requested or os.environ.get("KVSWAP_GPU_BACKEND") or "auto").lower()
    if choice == "auto":
        return list(FRAMEWORKS)
    if choice not in FRAMEWORKS:
        raise InvalidLayout(f"unknown GPU framework {choice!r} in KVSWAP_GPU_BACKEND; use one of auto, "
                            f"{', '.join(FRAMEWORKS)}", framework=choice)
    return [choice]


def _make_kernels(name: str, device: Any, bases: list[int], sizes: list[int], placements: Sequence[Placement],
                  record_bytes: int, batch: int) -> Kernels:
    if importlib.util.find_spec(name) is None:
        raise InvalidLayout(f"{name} is not installed")
    if name == "paddle":
        paddle = import_paddle()
        if not paddle.is_compiled_with_cuda():
            raise InvalidLayout("this paddle is a CPU build (install paddlepaddle-gpu)")

        def upload(address: int, values: np.ndarray, stream: int) -> None:
            if values.nbytes:
                device.copy_htod_async(address, values.ctypes.data, values.nbytes, stream)

        # Paddle initialises its GPU runtime on first use: keep our signals through that too.
        with keep_signal_handlers():
            paddle.set_device(f"gpu:{device.ordinal}")
            return PaddleKernels(paddle, bases, sizes, placements, record_bytes, upload, on_gpu=True,
                                 device_id=device.ordinal)
    cupy = _import("cupy")
    return ChunkKernels(CupyChunkRunner(cupy, device), bases, placements, record_bytes, batch)


def attach_cuda_ipc(layout: CacheLayout, placements: Sequence[Placement], handles: Sequence[dict[str, Any]],
                    framework: str | None = None, staging_bytes: int = DEFAULT_DEVICE_STAGING_BYTES) -> DeviceMover:
    """Open the engine's ``cuda_ipc`` handles and build the mover over them.

    Checks, in order: every handle field; that the regions fit the sizes the engine declared;
    that this machine has a CUDA driver, the engine's GPU and a GPU framework (paddle or CuPy);
    that every handle opens; that each mapped allocation is at least its declared size and
    holds its regions. Any failure closes what was opened and raises :class:`InvalidLayout`
    (or :class:`CudaError`, an ``unavailable``, for a device that fails mid-way).
    """
    specs = parse_cuda_handles(handles)
    check_fits(placements, [s.size for s in specs], layout.num_blocks)
    order = framework_order(framework)
    try:
        driver = CudaDriver.load()
    except CudaError as exc:
        raise InvalidLayout(f"cuda_ipc handles need a CUDA GPU, and this daemon has none: {exc.message}",
                            field="handles[0].kind", reason=exc.cuda_error or "no_cuda") from None
    ordinal = find_ordinal(driver, specs[0].device_uuid, specs[0].device)
    device = CudaDevice(driver, ordinal)
    opened: list[bytes] = []

    def close_mappings() -> None:
        device.activate()
        while opened:
            IPC_MAPPINGS.close(device, opened.pop())

    try:
        device.activate()
        bases, sizes = [], []
        for s in specs:
            try:
                ptr = IPC_MAPPINGS.open(device, s.ipc_handle)
            except CudaError as exc:
                raise InvalidLayout(f"handles[{s.index}]: cannot open the CUDA IPC handle ({exc.cuda_error}); is the "
                                    "engine alive, on this machine, and exporting this allocation?",
                                    field=f"handles[{s.index}].ipc_handle", cuda_error=exc.cuda_error) from None
            opened.append(s.ipc_handle)
            base, size = device.address_range(ptr)
            mapped = base + size - ptr
            if mapped < s.size:
                raise InvalidLayout(f"handles[{s.index}] maps {mapped} bytes, less than the declared {s.size}",
                                    field=f"handles[{s.index}].size", mapped=mapped, declared=s.size)
            bases.append(ptr)
            sizes.append(mapped)
        check_fits(placements, sizes, layout.num_blocks)
        batch = records_per_batch(layout.record_bytes, staging_bytes)
        reasons = []
        kernels = None
        for name in order:
            try:
                kernels = _make_kernels(name, device, bases, sizes, placements, layout.record_bytes, batch)
                break
            except Exception as exc:  # noqa: BLE001 - a framework may fail any way; try the next, say why
                log.warning("GPU framework %s unusable: %s", name, exc)
                reasons.append(f"{name}: {getattr(exc, 'message', None) or exc}")
        if kernels is None:
            # The reason code keeps its published name (see the module doc).
            raise InvalidLayout("no usable GPU framework: " + "; ".join(reasons), field="handles[0].kind",
                                reason="no_gpu_backend")
        copier = CudaCopier(device, kernels.stream)
    except BaseException:
        try:
            close_mappings()
        finally:
            device.release()
        raise
    info = {"device": ordinal, "handles": [{"kind": "cuda_ipc", "size": s, "device": ordinal} for s in sizes]}
    return DeviceMover(kernels, copier, placements, layout.record_bytes, batch,
                       synchronize=lambda: device.synchronize(kernels.stream), activate=device.activate,
                       on_close=[close_mappings, device.release], info=info)
