"""The checkpoint format's names and keys, in one place: file names, manifest fields, dict keys.

MiniMind (lesson 15) writes ``{out_dir}/{stem}.pth`` (fp16 weights) and
``{ckpt_dir}/{stem}_resume.pth`` (``model`` fp16, ``optimizer``, ``epoch``, ``step``, ``world_size``,
``wandb_id``, ``scaler``), ``stem`` = ``{weight}_{hidden}{_moe}``. Our Lightning checkpoints carry
those keys too (:mod:`lit_minimind.checkpoint.weights`); this module is what writers, readers,
``inspect`` and the DataModule agree on.
"""

from __future__ import annotations

import os
from pathlib import Path

MANIFEST_SUFFIX = ".manifest.json"
MINIMIND_KEYS = ("model", "optimizer", "epoch", "step")  # what MiniMind's lm_checkpoint reads
POSITION_KEYS = ("epoch", "step", "world_size", "wandb_id")  # MiniMind's position keys
MANIFEST_FIELDS = ("epoch", "step", "world_size", "global_step", "wandb_id")  # copied into a .ckpt's manifest
MODULE_PREFIX = "model."  # LitMiniMind keeps MiniMindForCausalLM as ``self.model``
DATA_STATE_KEY = "MiniMindDataModule"  # where Lightning keeps the DataModule's state (its __qualname__)
RESUME_STATE_KEY = "ResumeCallback"  # where Lightning keeps ResumeCallback's state (``callbacks[...]``)
HF_CONFIG_KEY = "hf_config"  # a Hugging Face directory read as a checkpoint dict (its config.json)
TRAINING_STATE_KEY = "lit_minimind"  # per-rank RNG (a save is taken at an optimizer-step boundary: no gradients)
TRAINING_STATE_FORMAT = 3  # of TRAINING_STATE_KEY: 3 = RNG only (1, 2: partial gradients inline / in shards)
LORA_KEY = ".lora."  # in every LoRA adapter's key (MiniMind's ``lora`` modules)
CALLBACK_FORMAT_VERSION = 2  # of ResumeCallback's state


def checkpoint_paths(save_dir: str | os.PathLike, weight: str, hidden_size: int, use_moe: bool = False) -> tuple[Path, Path]:
    """MiniMind's names: ``(save_dir/{weight}_{hidden}{_moe}.pth, save_dir/..._resume.pth)``."""
    weights, resume = minimind_file_names(checkpoint_stem(weight, hidden_size, use_moe))
    return Path(save_dir) / weights, Path(save_dir) / resume


def minimind_file_names(stem: str) -> tuple[str, str]:
    """MiniMind's two file names for a stem: the fp16 export and the resume checkpoint."""
    return f"{stem}.pth", f"{stem}_resume.pth"


def checkpoint_stem(weight: str, hidden_size: int, use_moe: bool = False) -> str:
    return f"{weight}_{hidden_size}{'_moe' if use_moe else ''}"


def manifest_path(path: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(path)}{MANIFEST_SUFFIX}")

