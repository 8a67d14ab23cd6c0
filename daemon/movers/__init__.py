"""Movers: the byte copies between an engine's KV memory and the daemon's record slots.

One interface (:class:`~.base.Mover`), two families:

- host memory — the engine's cache is a POSIX shared-memory segment, laid out as
  :mod:`.copy_plan` models it: :mod:`.segment` moves it through the native fault-guarded copy
  of :mod:`.native` (``_fastcopy.c``) or ``preadv``/``pwritev`` (the tests' plain numpy twin,
  ``HostMover``, lives in ``kvswap/testing/reference_mover.py``);
- the GPU family — :mod:`.cuda_attach` opens an engine's CUDA IPC handles and builds a
  :class:`~.device.DeviceMover` from :mod:`.kernels` (device side) and :mod:`.copiers` (device
  to host), planned by :mod:`.gpu_plan` over the driver wrapper in :mod:`.cuda`.

Everything GPU-only (paddle, CuPy, the CUDA driver) is imported inside this package alone, and
only when a ``cuda_ipc`` registration arrives.
"""
