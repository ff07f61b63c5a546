"""Progress as MiniMind's console numbers it (1-based epochs, ``Epoch 3/3``): a tqdm bar in a terminal
(:class:`MiniMindProgressBar`), plain lines in a log file (:class:`PlainProgress`)."""

from __future__ import annotations

import datetime
import math
import re
import sys
import time
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ProgressBar, TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm, convert_inf


class _OneBasedEpochs(Tqdm):
    """Draws Lightning's ``Epoch N`` (0-based) as ``Epoch N+1/E``, so no frame shows the 0-based one."""

    epochs = 0

    def set_description(self, desc: str | None = None, refresh: bool = True) -> None:
        if m := re.fullmatch(r"Epoch (\d+)", desc or ""):
            desc = f"Epoch {int(m[1]) + 1}" + (f"/{self.epochs}" if self.epochs > 0 else "")
        super().set_description(desc, refresh)


class MiniMindProgressBar(TQDMProgressBar):
    """Lightning's tqdm bar with ``Epoch N/E`` (1-based, the console's numbering) and without ``v_num``.

    An epoch resumed mid-way gets its bar too: Lightning's fit loop calls no ``on_train_epoch_start`` for
    an epoch it restarts in the middle, and TQDMProgressBar sets the bar's ``total``
    (``total_train_batches``) and ``Epoch N`` only there, so the resumed epoch showed ``Training: | 12/?``
    (no epoch, no total, no ETA). Here the first batch of such an epoch sets the bar up as
    ``on_train_epoch_start`` does, starting at the resumed position: ``N/total`` and an ETA from the rate
    since the resume."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._bar_epoch: int | None = None  # the epoch the train bar was set up for

    def init_train_tqdm(self) -> Tqdm:
        bar = _OneBasedEpochs(desc=self.train_description, position=2 * self.process_position, disable=self.is_disabled,
                              leave=True, dynamic_ncols=True, file=sys.stdout, smoothing=0, bar_format=self.BAR_FORMAT)
        bar.epochs = self.trainer.max_epochs or 0
        return bar

    def on_train_epoch_start(self, trainer: L.Trainer, *args: Any) -> None:
        super().on_train_epoch_start(trainer, *args)
        self._bar_epoch = trainer.current_epoch

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if self._bar_epoch == trainer.current_epoch:
            return
        # an epoch resumed mid-way: what on_train_epoch_start sets (the total, "Epoch N/E"), at the resumed
        # position (tqdm's rate and ETA count from it), in one frame (no 0/total frame first)
        self._bar_epoch = trainer.current_epoch
        bar = self.train_progress_bar
        bar.total = convert_inf(self.total_train_batches)
        bar.initial = bar.n = bar.last_print_n = batch_idx
        bar.start_t = bar.last_print_t = time.time()  # tqdm's clock
        bar.set_description(f"Epoch {trainer.current_epoch}")  # drawn as Epoch N+1/E

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        return items


def _hms(seconds: float) -> str:
    return str(datetime.timedelta(seconds=int(round(seconds))))


class PlainProgress(ProgressBar):
    """Progress as plain lines, for a log file (a ``> log 2>&1``, nohup, SLURM): no tqdm bar, no ``\\r``.

    Every ``log_interval`` batches of an epoch, and at its last, on global rank 0, one line::

        progress: epoch 1/2 step 40/100 (40%) 12.3 it/s, eta 0:00:05

    the rate measured since the epoch's (or the resume's) first batch, the ETA that of the epoch's rest.
    ``log_interval`` unset: :class:`lit_minimind.callbacks.MiniMindConsole`'s, so each progress line
    follows MiniMind's console line. Lines printed through :meth:`print` (the console line) are plain prints.
    """

    def __init__(self, log_interval: int | None = None) -> None:
        super().__init__()
        if log_interval is not None and log_interval < 1:
            raise ValueError(f"log_interval must be >= 1, got {log_interval}")
        self.log_interval = log_interval
        self._enabled = True
        self._start: tuple[float, int] | None = None  # (time, batch_idx) of this epoch's first batch in this run

    @property
    def is_enabled(self) -> bool:
        return self._enabled

    @property
    def is_disabled(self) -> bool:
        return not self._enabled

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def print(self, *args: Any, sep: str = " ", **kwargs: Any) -> None:
        print(*args, sep=sep, flush=True, **{k: v for k, v in kwargs.items() if k != "flush"})

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.log_interval is None:
            from lit_minimind.callbacks.console import MiniMindConsole

            console = next((cb for cb in trainer.callbacks if isinstance(cb, MiniMindConsole)), None)
            self.log_interval = console.log_interval if console is not None else 100

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if self._start is None or self._start[1] > batch_idx:  # the epoch's first batch (a resumed epoch: no epoch start)
            self._start = (time.perf_counter(), batch_idx)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step, total = batch_idx + 1, self.total_train_batches
        known = total is not None and not math.isinf(total)
        if not self.is_enabled or not (step % (self.log_interval or 100) == 0 or (known and step == total)):
            return
        print(self.line(trainer, step, total if known else None), flush=True)

    def line(self, trainer: L.Trainer, step: int, total: int | float | None) -> str:
        """``progress: epoch E/EPOCHS step S/TOTAL (P%) R it/s, eta H:MM:SS`` (what is unknown is left out)."""
        epochs = trainer.max_epochs if trainer.max_epochs and trainer.max_epochs > 0 else None
        where = f"epoch {trainer.current_epoch + 1}" + (f"/{epochs}" if epochs else "")
        where += f" step {step}" + (f"/{int(total)} ({100 * step // int(total)}%)" if total else "")
        start_time, start_idx = self._start or (time.perf_counter(), step - 1)
        elapsed, done = time.perf_counter() - start_time, step - start_idx
        rate = done / elapsed if elapsed > 0 else 0.0
        eta = f", eta {_hms((total - step) / rate)}" if total and rate > 0 else ""
        return f"progress: {where} {rate:.1f} it/s{eta}"
