"""A callback that records whether building the model drew random numbers (test-only): at ``setup``, before
anything is restored or trained, the global generator is, or is not, still where ``seed_everything`` put it."""

from __future__ import annotations

import json

import lightning as L
import torch


class InitDraws(L.Callback):
    """Writes ``{"drew": bool}`` to ``path`` at setup."""

    def __init__(self, path: str = "init_draws.json") -> None:
        self.path = path

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        seeded = torch.Generator().manual_seed(torch.initial_seed()).get_state()
        with open(self.path, "w", encoding="utf-8") as f:
            json.dump({"drew": not torch.equal(torch.get_rng_state(), seeded)}, f)
