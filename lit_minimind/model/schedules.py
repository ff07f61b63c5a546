"""MiniMind's two LR rules, each in one place.

* :func:`minimind_lr`: pretraining, SFT, LoRA, DPO and distillation (``get_lr`` in MiniMind's ``trainer_utils``);
* :func:`annealed_lr`: GRPO, agent RL and PPO (``torch.optim.lr_scheduler.CosineAnnealingLR`` down to a tenth),
  whose state MiniMind's resume files hold as :func:`minimind_scheduler_state`.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["annealed_lr", "minimind_lr", "minimind_scheduler_state", "save_minimind_scheduler"]


def minimind_lr(step: int, total_steps: int, learning_rate: float, warmup_steps: int = 0) -> float:
    """MiniMind's cosine rule ``lr * (0.1 + 0.45 * (1 + cos(pi * t / T)))``.

    ``t`` is the 1-based micro-batch index ``epoch * iters + step``, ``T = epochs * iters``.
    With ``warmup_steps > 0`` (not MiniMind's default) the first micro-batches ramp linearly.
    """
    lr = learning_rate * (0.1 + 0.45 * (1 + math.cos(math.pi * step / total_steps)))
    if warmup_steps > 0 and step < warmup_steps:
        lr *= step / warmup_steps
    return lr


def annealed_lr(steps: int, total: int, peak: float) -> float:
    """``CosineAnnealingLR(T_max=total, eta_min=peak / 10)`` after ``steps`` scheduler steps."""
    eta_min = peak / 10
    return eta_min + (peak - eta_min) * (1 + math.cos(math.pi * steps / max(int(total), 1))) / 2


def minimind_scheduler_state(steps: int, total: int, peak: float) -> dict[str, Any]:
    """The ``state_dict`` of MiniMind's ``CosineAnnealingLR`` after ``steps`` steps (its resume file's ``scheduler``)."""
    lr = annealed_lr(steps, total, peak)
    return {"T_max": int(total), "eta_min": peak / 10, "base_lrs": [peak], "last_epoch": int(steps),
            "_step_count": int(steps) + 1, "_is_initial": False, "_get_lr_called_within_step": False, "_last_lr": [lr]}


def save_minimind_scheduler(checkpoint: dict[str, Any], key: str, optimizer: int, steps: int, total: int,
                            peak: float) -> None:
    """Write MiniMind's ``key`` (its scheduler's state after ``steps``) into a checkpoint, and the LR MiniMind's
    saved optimizer holds (its scheduler already stepped: the next step's) into optimizer ``optimizer``'s groups;
    the port sets its LR itself at every step, so only MiniMind's ``--from_resume`` reads either."""
    checkpoint[key] = minimind_scheduler_state(steps, total, peak)
    optimizers = checkpoint.get("optimizer_states") or []
    if optimizer < len(optimizers):
        for group in optimizers[optimizer]["param_groups"]:
            group["lr"] = checkpoint[key]["_last_lr"][0]
