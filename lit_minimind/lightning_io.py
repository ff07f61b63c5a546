"""Bridges between MiniMind's files and Lightning's checkpoint machinery.

* :class:`SafeCheckpointIO` - Lightning's checkpoint plugin with our atomic writer and
  safe reader; it also reads MiniMind ``_resume.pth`` files, converted on the fly, so
  ``trainer.fit(ckpt_path=...)`` accepts all three forms.
* :func:`fit_loop_state_at` - the fit-loop progress Lightning would have saved in
  ``on_train_batch_end`` after ``step`` batches of ``epoch``. Lightning has no API to set
  a loop position, so this is written by hand against the counters Lightning 2.6 saves;
  it serves MiniMind files (which carry no loop state) and world-size changes.
"""

from __future__ import annotations

import copy
import math
import os
from typing import Any

import lightning
import torch
from lightning.fabric.plugins import TorchCheckpointIO

from lit_minimind.checkpoint import (
    EXTRA_KEY,
    CheckpointError,
    atomic_save,
    checkpoint_kind,
    manifest_path,
    read_checkpoint,
)

RESUME_STATE_KEY = "ResumeCallback"
MODULE_PREFIX = "model."  # LitMiniMind keeps MiniMindForCausalLM as ``self.model``


def minimind_to_lightning(ckpt: dict[str, Any]) -> dict[str, Any]:
    """A MiniMind resume dict (ours or original MiniMind's) as a Lightning checkpoint dict.

    Loop progress is left out (``loops: None``); :class:`callbacks.ResumeCallback` fills it
    in from ``epoch``/``step`` once it knows the epoch length.
    """
    extra = ckpt.get(EXTRA_KEY) or {}
    weights = extra.get("model_fp32") or {k: v.float() for k, v in ckpt["model"].items()}
    state = dict(extra.get("callback") or {})
    state.setdefault("epoch", int(ckpt["epoch"]))
    state.setdefault("step", int(ckpt["step"]))
    state.setdefault("world_size", int(ckpt.get("world_size") or 1))
    state.setdefault("wandb_id", ckpt.get("wandb_id"))
    state.setdefault("global_step", None)
    state["source_format"] = "minimind_resume" if not extra else "lit_minimind_resume"
    converted: dict[str, Any] = {
        "state_dict": {MODULE_PREFIX + k: v for k, v in weights.items()},
        "optimizer_states": [ckpt["optimizer"]],
        "lr_schedulers": [],
        "callbacks": {RESUME_STATE_KEY: state},
        "pytorch-lightning_version": lightning.__version__,
        "epoch": state["epoch"],
        "global_step": state["global_step"] or 0,
        "loops": None,
    }
    if ckpt.get("scaler"):
        converted["MixedPrecision"] = ckpt["scaler"]
    if extra.get("hyper_parameters"):
        converted["hyper_parameters"] = extra["hyper_parameters"]
    return converted


def fit_loop_state_at(
    template: dict[str, Any], epoch: int, step: int, iters: int, accumulate: int, global_step: int
) -> dict[str, Any]:
    """Fit-loop state as saved by Lightning in ``on_train_batch_end`` of batch ``step`` (1-based).

    ``template`` is a fresh ``trainer.fit_loop.state_dict()``; ``iters`` the batches per
    epoch on this rank; ``global_step`` the optimizer steps taken so far.
    """
    if step < 1:
        raise ValueError("fit_loop_state_at needs step >= 1 (a batch must have finished)")
    state = copy.deepcopy(template)
    stepped = step % accumulate == 0 or step == iters
    steps_in_epoch = step // accumulate + (1 if step == iters and step % accumulate else 0)
    windows_in_epoch = math.ceil(step / accumulate)
    windows_before = epoch * math.ceil(iters / accumulate)
    batches_before = epoch * iters

    def processed(total: int) -> dict[str, int]:
        return {"ready": total, "completed": total - 1, "started": total, "processed": total}

    state["epoch_loop.state_dict"] = {"_batches_that_stepped": global_step - (1 if stepped else 0)}
    state["epoch_loop.batch_progress"] = {
        "total": processed(batches_before + step),
        "current": processed(step),
        "is_last_batch": step == iters,
    }
    optim = state["epoch_loop.automatic_optimization.optim_progress"]["optimizer"]
    optim["step"] = {
        "total": {"ready": global_step, "completed": global_step},
        "current": {"ready": steps_in_epoch, "completed": steps_in_epoch},
    }
    zg_total, zg_current = windows_before + windows_in_epoch, windows_in_epoch
    optim["zero_grad"] = {
        "total": {"ready": zg_total, "completed": zg_total, "started": zg_total},
        "current": {"ready": zg_current, "completed": zg_current, "started": zg_current},
    }
    epoch_counts = {"ready": epoch + 1, "completed": epoch, "started": epoch + 1, "processed": epoch}
    state["epoch_progress"] = {"total": dict(epoch_counts), "current": dict(epoch_counts)}
    return state


class SafeCheckpointIO(TorchCheckpointIO):
    """Lightning checkpoint I/O: atomic, verified writes; ``weights_only`` reads; MiniMind files."""

    def __init__(self) -> None:
        super().__init__()
        self._error: OSError | None = None

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Atomic write; an OSError is kept for :meth:`take_error` instead of raised, so that rank 0
        still reaches Lightning's barrier and the failure can stop every rank together."""
        state = (checkpoint.get("callbacks") or {}).get(RESUME_STATE_KEY) or {}
        keys = ("epoch", "step", "world_size", "global_step", "wandb_id", "run_id")
        try:
            atomic_save(checkpoint, path, {"kind": "lightning", **{k: state[k] for k in keys if k in state}})
        except OSError as err:
            self._error = err

    def take_error(self) -> OSError | None:
        """The error of the last failed save (then cleared), or None."""
        error, self._error = self._error, None
        return error

    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None) -> dict[str, Any]:
        ckpt = read_checkpoint(path, map_location or "cpu")
        kind = checkpoint_kind(ckpt)
        if kind == "lightning":
            return ckpt
        if kind == "minimind_resume":
            return minimind_to_lightning(ckpt)
        if kind == "weights":
            raise CheckpointError(
                f"{path}: holds model weights only (an fp16 export?), not a resume checkpoint; "
                "pass the matching *_resume.pth or a Lightning .ckpt"
            )
        raise CheckpointError(f"{path}: not a lit-minimind, Lightning or MiniMind checkpoint (keys: {sorted(ckpt)[:8]})")

    def remove_checkpoint(self, path: Any) -> None:
        for p in (path, manifest_path(path)):
            try:
                os.remove(p)
            except FileNotFoundError:
                pass


def rng_state() -> dict[str, Any]:
    """Every RNG a training step may draw from, as plain tensors (loadable with ``weights_only``)."""
    import random

    import numpy as np

    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (np_state[0], torch.from_numpy(np_state[1].astype("int64")), *np_state[2:]),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import random

    import numpy as np

    torch.set_rng_state(state["torch"])
    python = state["python"]
    random.setstate((python[0], tuple(python[1]), python[2]))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


__all__ = ["SafeCheckpointIO", "minimind_to_lightning", "fit_loop_state_at", "rng_state", "set_rng_state", "CheckpointError"]
