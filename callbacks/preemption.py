"""Preemption signals as a request to stop cleanly (hand-written: Lightning only handles SIGTERM,
by raising at the end of the current batch, mid accumulation window, and never saves first)."""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType
from typing import Any

import torch

STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1")


class StopRequest:
    """Records the first SIGTERM / SIGINT / SIGUSR1; a second SIGINT aborts at once (exit 130).

    One per process (:data:`STOP`): ``python -m lit_minimind.fit`` installs it first thing, so a
    signal during start-up is recorded too; :class:`callbacks.ResumeCallback` installs it again
    when training starts, replacing the SIGTERM handler Lightning registers just before.
    """

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def install(self) -> None:
        """Handle the stop signals (main thread only; idempotent)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for name in STOP_SIGNALS:
            signum = getattr(signal, name, None)
            if signum is None:
                continue
            previous = signal.signal(signum, self._handle)
            if previous is not self._handle:  # a bound method compares equal to itself
                self._previous.setdefault(signum, previous)

    def uninstall(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()

    def agreed(self, trainer: Any) -> bool:
        """True when a stop was requested on any rank (a collective under DDP: call it on every rank)."""
        if trainer.world_size == 1:
            return self.requested
        flag = torch.tensor([1.0 if self.requested else 0.0], device=trainer.strategy.root_device)
        return bool(trainer.strategy.reduce(flag, reduce_op="max").item() > 0)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signal_name is not None and name == "SIGINT":
            print("second SIGINT: aborting now, without saving", flush=True)
            os._exit(130)
        if self.signal_name is None:
            self.signal_name = name
            print(f"{name} received: finishing the current optimizer step, then saving and stopping "
                  "(press Ctrl-C again to abort at once)", flush=True)


STOP = StopRequest()
