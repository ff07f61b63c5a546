"""A callback that writes every GRPO step's rollout to a jsonl file (test-only): the sampled token ids, the
rewards and the step's full-precision statistics, to compare with MiniMind's own (tests/fixtures/grpo)."""

from __future__ import annotations

import json
from typing import Any

import lightning as L


class RolloutLog(L.Callback):
    """One line per trained step: ``epoch`` (0-based), ``step`` (1-based), ``completion_ids``, ``rewards``, and
    the module's ``last_stats`` as floats."""

    def __init__(self, path: str = "rollouts.jsonl") -> None:
        self.path = path

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not trainer.is_global_zero:
            return
        row = {"epoch": trainer.current_epoch, "step": batch_idx + 1,
               "completion_ids": pl_module.rollout_log["completion_ids"].tolist(),
               "rewards": pl_module.rollout_log["rewards"].tolist(),
               **{k: float(v) for k, v in pl_module.last_stats.items()}}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
