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


def rollout_rows(run_dir: Any, key: str | None = None) -> dict[tuple[int, int], Any]:
    """A run directory's ``rollouts.jsonl`` by (epoch, step): each row (or its ``key``); a step trained twice (its
    run killed after it, before its checkpoint) must be rolled out alike both times."""
    from pathlib import Path

    rows: dict[tuple[int, int], Any] = {}
    for line in (Path(run_dir) / "rollouts.jsonl").read_text().splitlines():
        row = json.loads(line)
        value = row if key is None else row[key]
        assert rows.setdefault((row["epoch"], row["step"]), value) == value, f"step {row['epoch']}/{row['step']} differs"
    return rows
