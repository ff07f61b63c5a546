"""MiniMind's console line, printed every ``log_interval`` batches, and a closing summary."""

from __future__ import annotations

import math
import time
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback


def format_minimind_line(epoch: int, epochs: int, step: int, iters: int, loss: float, logits_loss: float,
                         aux_loss: float, lr: float, eta_min: float) -> str:
    """MiniMind's exact log format, so existing log parsers keep working."""
    return (
        f"Epoch:[{epoch + 1}/{epochs}]({step}/{iters}), loss: {loss:.4f}, logits_loss: {logits_loss:.4f}, "
        f"aux_loss: {aux_loss:.4f}, lr: {lr:.8f}, epoch_time: {eta_min:.1f}min"
    )


class MiniMindConsole(Callback):
    """MiniMind's logging: its console line and per-micro-batch metrics for the loggers.

    Prints MiniMind's line on global rank 0 every ``log_interval`` steps and at each epoch's last,
    and sends every micro-batch's ``loss``, ``logits_loss``, ``aux_loss``, ``learning_rate``,
    ``epoch_time``, ``tokens_per_s``, ``perplexity`` and ``micro_step`` (the 1-based micro-batch
    index over the whole run, the same after a resume) to the trainer's loggers.

    ``epoch_time`` is MiniMind's estimate of the minutes left in the epoch, measured from the
    epoch's (or the resume's) first batch. Also keeps what the end-of-run summary reports.

    Args:
        log_interval: print every this many batches of an epoch (MiniMind's ``log_interval``).
    """

    def __init__(self, log_interval: int = 100) -> None:
        if log_interval < 1:
            raise ValueError(f"log_interval must be >= 1, got {log_interval}")
        self.log_interval = log_interval
        self.first_loss: float | None = None
        self._last_loss: Any = None  # the last micro-batch's loss tensor: converted once, in last_loss
        self.batches = 0
        self.tokens = 0
        self.train_seconds = 0.0
        self._epoch_start: tuple[float, int] | None = None
        self._fit_start = 0.0
        self._last_batch_end = 0.0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._fit_start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        step, iters = batch_idx + 1, int(trainer.num_training_batches)
        if self._epoch_start is None or self._epoch_start[1] > batch_idx:
            self._epoch_start = (time.perf_counter(), batch_idx)
        self.batches += 1
        tokens = int(batch[1].numel()) * trainer.world_size
        self.tokens += tokens
        now = time.perf_counter()
        tokens_per_s = tokens / max(now - self._last_batch_end, 1e-9) if self._last_batch_end else 0.0
        self._last_batch_end = now
        stats = pl_module.last_stats
        if self.first_loss is None:
            self.first_loss = float(stats["loss"])
        self._last_loss = stats["loss"]
        start_time, start_idx = self._epoch_start
        spent = time.perf_counter() - start_time
        eta_min = spent / max(batch_idx + 1 - start_idx, 1) * (iters - step) // 60
        self.log_micro_batch(trainer, stats, epoch_time=eta_min, tokens_per_s=tokens_per_s,
                             micro_step=trainer.current_epoch * iters + step)
        if not (step % self.log_interval == 0 or step == iters):
            return
        loss, aux = float(stats["loss"]), float(stats["aux_loss"])
        if not trainer.is_global_zero:
            return
        print(format_minimind_line(trainer.current_epoch, trainer.max_epochs or 1, step, iters, loss, loss - aux,
                                   aux, float(stats["lr"]), eta_min), flush=True)

    @property
    def last_loss(self) -> float | None:
        """The loss of the last trained micro-batch of this run (None before the first)."""
        return None if self._last_loss is None else float(self._last_loss)

    @staticmethod
    def log_micro_batch(trainer: L.Trainer, stats: dict[str, Any], **extra: float) -> None:
        if not trainer.loggers or not trainer.is_global_zero:
            return
        loss, logits_loss = float(stats["loss"]), float(stats["logits_loss"])
        metrics = {"loss": loss, "logits_loss": logits_loss, "aux_loss": float(stats["aux_loss"]),
                   "learning_rate": float(stats["lr"]), "perplexity": math.exp(min(logits_loss, 50.0)),
                   "epoch": float(trainer.current_epoch), **extra}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._epoch_start = None

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.train_seconds = time.perf_counter() - self._fit_start
