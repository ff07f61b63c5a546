"""Counts host-device synchronisation points per micro-batch (test-only callback).

Every call of a tensor method that hands a value to Python (``item``, ``tolist``, ``__bool__``,
``__float__``, ``__int__``, ``nonzero``) is a sync on a GPU. Counted from one batch's start to the
next one's, i.e. the batch, its hooks, and fetching the next batch; written to ``syncs_rank{R}.json``.
"""

from __future__ import annotations

import json
import traceback
from typing import Any

import lightning as L
import torch

SYNC_METHODS = ("item", "tolist", "__bool__", "__float__", "__int__", "nonzero")
# Lightning's own per-batch SIGTERM agreement under DDP (a broadcast and .item() every batch)
LIGHTNING_OWN = ("_broadcast_sigterm_tensor",)
# AdamW reads its step counter, a CPU tensor even when training on a GPU (not capturable): no device sync
CPU_BOOKKEEPING = ("/torch/optim/",)


class SyncCounter(L.Callback):
    def __init__(self) -> None:
        self.counts: dict[str, list[str]] = {}
        self._batch: str | None = None
        self._originals: dict[str, Any] = {}

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        for name in SYNC_METHODS:
            original = getattr(torch.Tensor, name)
            self._originals[name] = original

            def counted(tensor: torch.Tensor, *args: Any, _original: Any = original, _name: str = name, **kwargs: Any) -> Any:
                if self._batch is not None:
                    stack = traceback.extract_stack(limit=12)[:-1]
                    if not any(frame.name in LIGHTNING_OWN or any(p in frame.filename for p in CPU_BOOKKEEPING)
                               for frame in stack):
                        caller = next((f for f in reversed(stack) if "/torch/" not in f.filename), stack[-1])
                        self.counts[self._batch].append(f"{_name} {caller.filename.split('/')[-1]}:{caller.lineno}")
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, counted)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self._batch = f"{trainer.current_epoch}:{batch_idx + 1}"
        self.counts[self._batch] = []

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._batch = None

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._batch = None
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, original)
        # one file per rank: ranks printing to one pipe at once can interleave their lines
        with open(f"syncs_rank{trainer.global_rank}.json", "w") as f:
            json.dump({"rank": trainer.global_rank, "counts": self.counts}, f)
