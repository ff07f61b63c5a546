"""The checkpoint format's names and keys, in one place: file names, manifest fields, dict keys.

MiniMind (lesson 15) writes ``{out_dir}/{stem}.pth`` (fp16 weights) and
``{ckpt_dir}/{stem}_resume.pth`` (``model`` fp16, ``optimizer``, ``epoch``, ``step``, ``world_size``,
``wandb_id``, ``scaler``), ``stem`` = ``{weight}_{hidden}{_moe}``. Our Lightning checkpoints carry
those keys too (:mod:`lit_minimind.checkpoint.weights`); this module is what writers, readers,
``inspect`` and the DataModule agree on.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

MANIFEST_SUFFIX = ".manifest.json"
MINIMIND_KEYS = ("model", "optimizer", "epoch", "step")  # what MiniMind's lm_checkpoint reads
POSITION_KEYS = ("epoch", "step", "world_size", "wandb_id")  # MiniMind's position keys
MANIFEST_FIELDS = ("epoch", "step", "world_size", "global_step", "wandb_id")  # copied into a .ckpt's manifest
MODULE_PREFIX = "model."  # LitMiniMind keeps MiniMindForCausalLM as ``self.model``
DATA_STATE_KEY = "MiniMindDataModule"  # where Lightning keeps the DataModule's state (its __qualname__)
RESUME_STATE_KEY = "ResumeCallback"  # ResumeCallback.state_key: where Lightning keeps its state (``callbacks[...]``)
CONSOLE_STATE_KEY = "MiniMindConsole"  # MiniMindConsole.state_key
HF_CONFIG_KEY = "hf_config"  # a Hugging Face directory read as a checkpoint dict (its config.json)
FIELDS_KEY = "minimind_config"  # beside HF_CONFIG_KEY: its MiniMindConfig fields (checkpoint.hf.read_hf_directory)
TRAINING_STATE_KEY = "lit_minimind"  # per-rank RNG (a save is taken at an optimizer-step boundary: no gradients)
TRAINING_STATE_FORMAT = 3  # of TRAINING_STATE_KEY: 3 = RNG only (1, 2: partial gradients inline / in shards)
LORA_KEY = ".lora."  # in every LoRA adapter's key (MiniMind's ``lora`` modules)
CALLBACK_FORMAT_VERSION = 2  # of ResumeCallback's state
START_WEIGHTS_KEY = "start_weights"  # {"path", "sha256"} of --from_weight in LoRA, DPO, GRPO and PPO checkpoints
TEACHER_KEY = "teacher"  # {"path", "sha256"} of --model.teacher in distillation checkpoints
LR_SCHEDULE_KEY = "lr_schedule"  # {"total": T of the LR rule}: a resume with another T says so
REWARD_MODEL_KEY = "reward_model"  # {"path", "sha256"} of --model.reward_model in GRPO and PPO checkpoints
PPO_STATE_KEY = "ppo"  # PPO's {"updates": optimizer steps so far, "minibatches": the epoch's accumulation counter}
MINIMIND_PPO_KEYS = ("critic_model", "critic_optimizer", "scheduler", "critic_scheduler")  # train_ppo.py's lm_checkpoint kwargs

# Everything one of our checkpoints holds, by top-level key: who provides it (each through its own public
# hook: a ``state_dict``, an ``on_save_checkpoint``) and what it is. ``tests/test_training.py`` checks a real
# checkpoint against it. Also, with fp16 only: the precision plugin's GradScaler under the plugin's class name
# (Lightning's key; ``resume.states.adopt_scaler_state`` carries it across plugins).
CHECKPOINT_SCHEMA: dict[str, str] = {
    "epoch": "Lightning: the epoch (0-based)",
    "global_step": "Lightning: optimizer steps taken",
    "pytorch-lightning_version": "Lightning",
    "state_dict": "Lightning, from LitMiniMind: fp32 weights (and the epoch's mean loss)",
    "loops": "Lightning: its loop counters",
    "callbacks": f"Lightning, from each callback's state_dict: {RESUME_STATE_KEY} (run id, the run's data and depth, save records, the save "
                 f"schedule's history), {CONSOLE_STATE_KEY} (micro_step, the rows a resume logs again, CSV log directories)",
    "optimizer_states": "Lightning: AdamW",
    "lr_schedulers": "Lightning: none (LitMiniMind sets MiniMind's LR itself)",
    "hparams_name": "Lightning", "hyper_parameters": "Lightning: LitMiniMind's arguments",
    "datamodule_hparams_name": "Lightning", "datamodule_hyper_parameters": "Lightning: the DataModule's arguments",
    DATA_STATE_KEY: "Lightning, from MiniMindDataModule.state_dict: the data position (epoch, step, world size, "
                    "epoch length, batch size, dataset length)",
    "model_config": "LitMiniMind.on_save_checkpoint: the model's shape",
    LR_SCHEDULE_KEY: "LitMiniMind.on_save_checkpoint: the LR rule's total steps (a resume with another says so)",
    START_WEIGHTS_KEY: "LitMiniMind.on_save_checkpoint, LoRA, DPO, GRPO and PPO only: path and sha256 of --from_weight",
    TEACHER_KEY: "LitMiniMind.on_save_checkpoint, distillation only: path and sha256 of --model.teacher",
    REWARD_MODEL_KEY: "LitMiniMind.on_save_checkpoint, GRPO and PPO with a reward model only: path and sha256 of "
                      "--model.reward_model",
    TRAINING_STATE_KEY: "ResumeCallback.on_save_checkpoint: every rank's RNG",
    "model": "ResumeCallback.on_save_checkpoint: MiniMind's fp16 weights",
    "optimizer": "ResumeCallback.on_save_checkpoint: MiniMind's optimizer state",
    "step": "ResumeCallback.on_save_checkpoint: MiniMind's step (batches of the epoch on one rank)",
    "world_size": "ResumeCallback.on_save_checkpoint: MiniMind's world size",
    "wandb_id": "ResumeCallback.on_save_checkpoint: the wandb run id (None without wandb)",
    "scaler": "ResumeCallback.on_save_checkpoint: MiniMind's GradScaler state ({} without one)",
    PPO_STATE_KEY: "LitMiniMind.on_save_checkpoint, PPO only: optimizer steps so far and the epoch's minibatch counter",
    "critic_model": "LitMiniMind.on_save_checkpoint, PPO only: the critic's fp32 weights (MiniMind's key)",
    "critic_optimizer": "LitMiniMind.on_save_checkpoint, PPO only: the critic's AdamW (optimizer_states[1])",
    "scheduler": "LitMiniMind.on_save_checkpoint, GRPO, agent RL and PPO only: MiniMind's (actor) CosineAnnealingLR state",
    "critic_scheduler": "LitMiniMind.on_save_checkpoint, PPO only: MiniMind's critic CosineAnnealingLR state",
}


_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_url(path: Any) -> bool:
    """A directory given as a URL (``scheme://...``) rather than a local path."""
    return isinstance(path, str) and bool(_URL.match(path))


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



@dataclass(frozen=True)
class CheckpointName:
    """The name of one save's checkpoint, ``{stem}_e{epoch}_s{step}_g{global_step}_{run_id}.ckpt``: the one
    place it is formatted, parsed and globbed (local directories and buckets alike)."""

    stem: str
    epoch: int
    step: int
    global_step: int
    run_id: str

    _PARSE = re.compile(r"^(?P<stem>.+)_e(?P<epoch>\d+)_s(?P<step>\d+)_g(?P<global_step>\d+)_(?P<run_id>[0-9a-f]+)\.ckpt$")

    def __str__(self) -> str:
        return f"{self.stem}_e{self.epoch}_s{self.step}_g{self.global_step}_{self.run_id}.ckpt"

    @staticmethod
    def pattern(stem: str) -> str:
        """The glob that finds every checkpoint of ``stem`` (and only those: not ``_best.ckpt``)."""
        return f"{stem}_e*_s*_g*.ckpt"

    @classmethod
    def parse(cls, name: str) -> CheckpointName | None:
        """The parts of a checkpoint's file name (None: not one of ours)."""
        match = cls._PARSE.match(Path(name).name)
        if match is None:
            return None
        parts = match.groupdict()
        return cls(parts["stem"], int(parts["epoch"]), int(parts["step"]), int(parts["global_step"]), parts["run_id"])

    @classmethod
    def of(cls, stem: str, position: dict) -> CheckpointName:
        """The name of the save a manifest (or a resume state) describes: its epoch, step, global step, run id."""
        return cls(stem, int(position["epoch"]), int(position["step"]), int(position["global_step"]),
                   str(position["run_id"]))

    @classmethod
    def find(cls, directory: str | os.PathLike, stem: str) -> list[Path]:
        """Every checkpoint of ``stem`` in a local ``directory``."""
        return [p for p in Path(directory).glob(cls.pattern(stem)) if cls.parse(p.name) is not None]


File = TypeVar("File")


def expired(saves: Iterable[tuple[File, str | None, Any]], run_id: str, keep_last: int) -> list[File]:
    """Retention, one rule for a local directory and a bucket: of ``(file, its run id, when it was saved)``,
    run ``run_id``'s files beyond its newest ``keep_last`` (another run's files are never expired)."""
    ours = sorted((save for save in saves if save[1] == run_id), key=lambda save: save[2], reverse=True)
    return [save[0] for save in ours[keep_last:]]
