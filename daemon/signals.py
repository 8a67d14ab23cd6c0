"""Signals like uvicorn: the handlers only call back into the daemon (which sets a flag its
loop notices), and the handlers that were in place before are restored when it stops, so code
that embeds ``run(config)`` gets its own SIGINT handling back."""

from __future__ import annotations

import asyncio
import signal
import threading
from typing import Any, Callable

#: Signals that drain the daemon; a second one of any of them forces the exit. SIGHUP is here
#: because a daemon whose terminal or supervisor session goes away should drain, not die
#: mid-write (by default SIGHUP killed it, exit 129).
HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class SignalCapture:
    """Routes HANDLED_SIGNALS to ``on_signal(signum)`` between ``install`` and ``restore``."""

    def __init__(self, on_signal: Callable[[int], None]) -> None:
        self.on_signal = on_signal
        self._previous: dict[int, Any] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def install(self) -> None:
        """On the running loop; only on the main thread (tests run daemons on other threads,
        where Python cannot take signals)."""
        if threading.current_thread() is not threading.main_thread():
            return
        self._loop = asyncio.get_running_loop()
        for sig in HANDLED_SIGNALS:
            self._previous[sig] = signal.getsignal(sig)
            self._loop.add_signal_handler(sig, self.on_signal, sig)

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            if self._loop is not None:
                self._loop.remove_signal_handler(sig)
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
