"""The course API of MiniMind's lesson 15 for plain PyTorch loops: save and load MiniMind's two files."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lit_minimind.checkpoint.atomic import atomic_save
from lit_minimind.checkpoint.names import MINIMIND_KEYS, checkpoint_paths
from lit_minimind.checkpoint.read import read_checkpoint
from lit_minimind.checkpoint.weights import checkpoint_kind, fp16_state_dict
from lit_minimind.errors import CheckpointError
from lit_minimind.resume.states import corrected_step, world_size_change

log = logging.getLogger(__name__)


def current_world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def save_resume_checkpoint(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    save_dir: str | os.PathLike,
    weight: str,
    hidden_size: int,
    use_moe: bool,
    epoch: int,
    step: int,
    scaler: Any | None = None,
    extra_state: Mapping[str, Any] | None = None,
    weights_dir: str | os.PathLike | None = None,
    wandb_id: str | None = None,
    world_size: int | None = None,
) -> tuple[Path, Path]:
    """Write MiniMind's two files (fp16 weights and the resume dict) atomically.

    ``weights_dir`` (default ``save_dir``) receives the fp16 weights, as MiniMind's
    ``out/``; ``extra_state`` entries are merged into the resume dict (objects with a
    ``state_dict()`` are stored by their state dict, as MiniMind's ``**kwargs``).
    Returns ``(weights_path, resume_path)``.
    """
    weights_path, _ = checkpoint_paths(weights_dir or save_dir, weight, hidden_size, use_moe)
    _, resume_path = checkpoint_paths(save_dir, weight, hidden_size, use_moe)
    weights = fp16_state_dict(model)
    world_size = current_world_size() if world_size is None else world_size
    position = {"epoch": epoch, "step": step, "world_size": world_size}
    atomic_save(weights, weights_path, {"kind": "weights", **position})
    resume: dict[str, Any] = {
        "model": weights,
        "optimizer": optimizer.state_dict(),
        **position,
        "wandb_id": wandb_id,
    }
    # always present: MiniMind's loader calls scaler.load_state_dict(ckp["scaler"]) unconditionally
    resume["scaler"] = scaler.state_dict() if scaler is not None else {}
    for key, value in (extra_state or {}).items():
        if value is not None:
            resume[key] = value.state_dict() if hasattr(value, "state_dict") else value
    atomic_save(resume, resume_path, {"kind": "minimind_resume", **position, "wandb_id": wandb_id})
    return weights_path, resume_path


def load_resume_checkpoint(
    save_dir: str | os.PathLike,
    weight: str,
    hidden_size: int,
    use_moe: bool = False,
    map_location: str | torch.device = "cpu",
    world_size: int | None = None,
) -> dict[str, Any] | None:
    """Read ``{save_dir}/{weight}_{hidden}{_moe}_resume.pth`` (``None`` when absent).

    As MiniMind's ``lm_checkpoint``, ``step`` is corrected when the saved world size
    differs from the current one (``world_size``, default: the process group's).
    """
    _, resume_path = checkpoint_paths(save_dir, weight, hidden_size, use_moe)
    if not resume_path.exists():
        return None
    ckpt = read_checkpoint(resume_path, map_location)
    if checkpoint_kind(ckpt) != "minimind_resume":
        raise CheckpointError(f"{resume_path}: not a MiniMind resume checkpoint (missing {', '.join(k for k in MINIMIND_KEYS if k not in ckpt)})")
    saved = int(ckpt.get("world_size") or 1)
    current = current_world_size() if world_size is None else world_size
    new_step = corrected_step(int(ckpt["step"]), saved, current)
    change = world_size_change(int(ckpt["step"]), saved, current, new_step)
    if change:
        log.warning(change)
        ckpt["step"] = new_step
    return ckpt
