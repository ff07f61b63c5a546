"""A progress bar that numbers epochs as MiniMind's console line does (1-based, ``Epoch 3/3``)."""

from __future__ import annotations

import re
import sys
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm


class _OneBasedEpochs(Tqdm):
    """Draws Lightning's ``Epoch N`` (0-based) as ``Epoch N+1/E``, so no frame shows the 0-based one."""

    epochs = 0

    def set_description(self, desc: str | None = None, refresh: bool = True) -> None:
        if m := re.fullmatch(r"Epoch (\d+)", desc or ""):
            desc = f"Epoch {int(m[1]) + 1}" + (f"/{self.epochs}" if self.epochs > 0 else "")
        super().set_description(desc, refresh)


class MiniMindProgressBar(TQDMProgressBar):
    """Lightning's tqdm bar with ``Epoch N/E`` (1-based, the console's numbering) and without ``v_num``."""

    def init_train_tqdm(self) -> Tqdm:
        bar = _OneBasedEpochs(desc=self.train_description, position=2 * self.process_position, disable=self.is_disabled,
                              leave=True, dynamic_ncols=True, file=sys.stdout, smoothing=0, bar_format=self.BAR_FORMAT)
        bar.epochs = self.trainer.max_epochs or 0
        return bar

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        return items
