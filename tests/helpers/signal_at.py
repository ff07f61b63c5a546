"""A callback that sends its own process a signal at one moment of start-up (test-only)."""

from __future__ import annotations

import os
import signal
from typing import Any

import lightning as L


class SignalAt(L.Callback):
    """Send ``signame`` to this process in ``phase``: ``setup`` (before restore and before Lightning
    registers its handlers), ``on_load_checkpoint`` (during restore), ``on_fit_start`` (after restore),
    ``train_dataloader`` (after Lightning's handler registration, before training) or
    ``on_train_batch_start`` (during the first batch). ``then_wait``: then wait there for the next signal
    (a test sends it once the first is reported: no race with training going on)."""

    def __init__(self, phase: str, signame: str = "SIGTERM", rank: int | None = None, then_wait: bool = False) -> None:
        self.phase, self.signum, self.sent, self.rank = phase, getattr(signal, signame), False, rank
        self.then_wait = then_wait
        self.global_rank = 0

    def _send(self, phase: str) -> None:
        if phase == self.phase and not self.sent and self.rank in (None, self.global_rank):
            self.sent = True
            os.kill(os.getpid(), self.signum)
            if self.then_wait:  # hold the process right here until the next signal's handler has run
                signal.pause()

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.global_rank = trainer.global_rank
        self._send("setup")
        if self.phase == "train_dataloader":
            make = trainer.datamodule.train_dataloader

            def train_dataloader() -> Any:
                self._send("train_dataloader")
                return make()

            trainer.datamodule.train_dataloader = train_dataloader

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        self._send("on_load_checkpoint")

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._send("on_fit_start")

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self._send("on_train_batch_start")
