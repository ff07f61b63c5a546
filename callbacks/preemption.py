"""Turning preemption signals into a request to stop cleanly (hand-written: Lightning only
handles SIGTERM, by raising mid-step, and never saves first)."""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType
from typing import Any

STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1")


class StopRequest:
    """Records the first SIGTERM / SIGINT / SIGUSR1; a second SIGINT aborts at once.

    Handlers are installed only in the main thread and restored by :meth:`uninstall`.
    """

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for name in STOP_SIGNALS:
            signum = getattr(signal, name, None)
            if signum is not None:
                self._previous[signum] = signal.signal(signum, self._handle)

    def uninstall(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signal_name is not None and name == "SIGINT":
            print("second SIGINT: aborting now, without saving", flush=True)
            os._exit(130)
        if self.signal_name is None:
            self.signal_name = name
            print(f"{name} received: finishing the current optimizer step, then saving and stopping "
                  "(press Ctrl-C again to abort at once)", flush=True)
