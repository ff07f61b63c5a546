"""MiniMind's file format, in one place.

MiniMind (lesson 15) writes ``out/{stem}.pth`` (fp16 weights) and ``checkpoints/{stem}_resume.pth``
(``model`` fp16, ``optimizer``, ``epoch``, ``step``, ``world_size``, ``wandb_id``, ``scaler``). Our
Lightning checkpoint carries those keys too (:func:`add_minimind_keys`), sharing the optimizer's
tensors with Lightning's ``optimizer_states`` so ``torch.save`` writes them once; ``_resume.pth``
is a hard link to the newest one. An original MiniMind file becomes a Lightning checkpoint in
:func:`to_lightning`; its missing loop counters are built by :func:`lit_minimind.lightning_io.loops_at`.
"""

from __future__ import annotations

from typing import Any

import lightning
import torch

MODULE_PREFIX = "model."  # LitMiniMind keeps MiniMindForCausalLM as ``self.model``
DATA_STATE_KEY = "MiniMindDataModule"  # where Lightning keeps the DataModule's state (its __qualname__)


def fp16_weights(lightning_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """MiniMind's export from a LightningModule state dict: its keys, fp16, on CPU."""
    halves: dict[int, torch.Tensor] = {}  # tied weights (embedding = lm_head) stay one tensor
    out = {}
    for k, v in lightning_state_dict.items():
        if k.startswith(MODULE_PREFIX):
            key = v.untyped_storage().data_ptr() + v.storage_offset()
            if key not in halves or halves[key].shape != v.shape:
                halves[key] = v.detach().half().cpu()
            out[k[len(MODULE_PREFIX):]] = halves[key]
    return out


def add_minimind_keys(checkpoint: dict[str, Any], *, step: int, world_size: int, wandb_id: str | None,
                      scaler_state: dict[str, Any] | None) -> dict[str, torch.Tensor]:
    """Make a Lightning checkpoint dict MiniMind's resume dict as well; returns the fp16 weights.

    ``epoch`` is Lightning's own key, equal to MiniMind's (the 0-based epoch of the position).
    ``scaler`` is always present: MiniMind's loader calls ``scaler.load_state_dict`` unconditionally.
    """
    weights = fp16_weights(checkpoint["state_dict"])
    checkpoint.update(model=weights, optimizer=checkpoint["optimizer_states"][0], step=step, world_size=world_size,
                      wandb_id=wandb_id, scaler=scaler_state or {})
    return weights


def to_lightning(ckpt: dict[str, Any]) -> dict[str, Any]:
    """An original MiniMind resume dict as a Lightning checkpoint dict (loop counters left to the resume)."""
    position = {"epoch": int(ckpt["epoch"]), "step": int(ckpt["step"]), "world_size": int(ckpt.get("world_size") or 1)}
    converted: dict[str, Any] = {
        "state_dict": {MODULE_PREFIX + k: v.float() for k, v in ckpt["model"].items()},
        "optimizer_states": [ckpt["optimizer"]],
        "lr_schedulers": [],
        "pytorch-lightning_version": lightning.__version__,
        "epoch": position["epoch"],
        "global_step": None,  # counted by the resume from the position and the accumulation
        "loops": None,
        DATA_STATE_KEY: position,
        "callbacks": {"ResumeCallback": {"wandb_id": ckpt.get("wandb_id"), "source_format": "minimind_resume"}},
    }
    if ckpt.get("scaler"):  # Lightning restores this key into any MixedPrecision plugin's scaler
        converted["native_amp_scaling_state"] = ckpt["scaler"]
    return converted


def model_weights(ckpt: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The model's weights with MiniMind's keys out of any checkpoint: ours or Lightning's (fp32),
    an original MiniMind resume dict or fp16 export (fp16)."""
    from lit_minimind.checkpoint import checkpoint_kind

    kind = checkpoint_kind(ckpt)
    if kind == "lightning":
        return {k[len(MODULE_PREFIX):]: v for k, v in ckpt["state_dict"].items() if k.startswith(MODULE_PREFIX)}
    if kind == "minimind_resume":
        return ckpt["model"]
    if kind == "weights":
        return ckpt
    raise ValueError(f"no model weights in a checkpoint with keys {sorted(ckpt)[:8]}")
