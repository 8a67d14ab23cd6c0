"""Processes: whether one is alive.

The one liveness check, used on both sides of the package: the daemon's engine watch (is the
process that registered the cache still there?) and the file tier's temp-file reclaim (is the
writer whose pid a temp name carries still there?).
"""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host (one owned by another user counts).

    >>> pid_alive(os.getpid())
    True
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
