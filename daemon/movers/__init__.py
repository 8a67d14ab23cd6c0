"""Movers: the byte copies between an engine's KV memory and the daemon's record slots.

One interface (:class:`~.base.Mover`), two families:

- :mod:`.host` — the engine's cache is host memory (POSIX shared memory): numpy/ctypes copies
  planned by :mod:`.copy_plan`; :mod:`.segment` moves an engine's segment, through the native
  fault-guarded copy of :mod:`.native` (``_fastcopy.c``) or ``preadv``/``pwritev``;
- the GPU family — :mod:`.cuda_attach` opens an engine's CUDA IPC handles and builds a
  :class:`~.device.DeviceMover` from :mod:`.kernels` (device side) and :mod:`.copiers` (device
  to host), planned by :mod:`.gpu_plan` over the driver wrapper in :mod:`.cuda`.

Everything GPU-only (paddle, CuPy, the CUDA driver) is imported inside this package alone, and
only when a ``cuda_ipc`` registration arrives.
"""
