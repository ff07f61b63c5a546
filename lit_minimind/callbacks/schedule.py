"""When to save: MiniMind's ``save_interval`` rule plus an optional wall-clock cadence."""

from __future__ import annotations

import time
from typing import Any


class SaveSchedule:
    """MiniMind saves after batch ``step`` when ``step % save_interval == 0 or step == iters``.

    With ``save_every_minutes`` it also saves at the first optimizer-step boundary after that many
    minutes (rank 0's clock decides, so every rank agrees; asked only at window boundaries).
    """

    def __init__(self, save_interval: int, save_every_minutes: float | None = None) -> None:
        if save_interval < 1:
            raise ValueError(f"save_interval must be >= 1, got {save_interval}")
        if save_every_minutes is not None and save_every_minutes <= 0:
            raise ValueError(f"save_every_minutes must be > 0, got {save_every_minutes}")
        self.save_interval = save_interval
        self.save_every_minutes = save_every_minutes
        self.last_save = time.monotonic()

    def by_step(self, step: int, iters: int) -> bool:
        return step % self.save_interval == 0 or step == iters

    def by_time(self, trainer: Any) -> bool:
        """A collective under DDP: call it on every rank, at the same step."""
        if self.save_every_minutes is None:
            return False
        due = time.monotonic() - self.last_save >= self.save_every_minutes * 60
        return bool(trainer.strategy.broadcast(due, src=0))

    def saved(self) -> None:
        self.last_save = time.monotonic()
