"""A callback that puts an op without a deterministic CPU kernel into the model's forward (test-only)."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F


class NondeterministicOp(L.Callback):
    """From the first training batch on, every forward of the model also runs ``max_unpool1d``
    (torch has no deterministic CPU kernel for it: under ``use_deterministic_algorithms(True)`` it raises)."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        def unpool(module: torch.nn.Module, args: Any) -> None:
            F.max_unpool1d(torch.ones(1, 1, 2), torch.tensor([[[0, 1]]]), kernel_size=2)

        next(pl_module.children()).register_forward_pre_hook(unpool)  # the network training_step calls
