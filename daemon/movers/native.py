"""The optional native copy helper (``_fastcopy.c``) and the one switch that turns it off.

``setup.py`` builds it at install time when a C compiler is present (``optional=True``: an
install without one succeeds). Movers ask :func:`load_copy_rows`; ``None`` means use the
pure-Python path.
"""

from __future__ import annotations

import os
from typing import Callable

#: Set to ``0`` to use the pure-Python copy path even where the helper is built.
ENV_VAR = "KVSWAP_NATIVE_COPY"

#: ``copy_rows(table, stop=None)``: see ``_fastcopy.c``.
CopyRows = Callable[..., int]
#: The helper's interface this code calls: 2 takes a stop flag. A helper built from older source
#: (an install not rebuilt) would ignore the flag, so it is not used at all.
API_VERSION = 2


def load_copy_rows(enabled: bool | None = None) -> CopyRows | None:
    """``copy_rows`` from the helper, or None if it is not built or turned off. ``enabled=None``
    reads :data:`ENV_VAR`; False never loads it (and so never installs its fault handler)."""
    if enabled is None:
        enabled = os.environ.get(ENV_VAR, "1") != "0"
    if not enabled:
        return None
    try:
        from . import _fastcopy  # type: ignore[attr-defined]  # a C extension, built at install
    except ImportError:
        return None
    if getattr(_fastcopy, "API_VERSION", 1) != API_VERSION:
        return None
    return _fastcopy.copy_rows
