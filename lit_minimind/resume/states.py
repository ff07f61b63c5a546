"""Every state a checkpoint needs that Lightning does not keep the way a resume needs it: where training
stands in the data (and MiniMind's world-size rule), each rank's RNG, and a loss scale across precision plugins.

**The data position.** MiniMind's rule (lesson 15): ``step`` counts the batches of an epoch on one rank, so a
run saved on ``W`` ranks resumes on ``W'`` ranks at ``step * W // W'``. Because every rank's samples come from
one world-size independent permutation (:class:`lit_minimind.data.sampler.EpochShardSampler`), those batches
cover exactly the samples already trained. This module is the only place with that rule, and with the
accumulation-window rule (:func:`window_complete`).

Loop counters for a position Lightning did not save are built in :mod:`lit_minimind.resume.internals`, with
every other use of Lightning's internals.

**Each rank's RNG** (:func:`save_rank_states`), gathered on global rank 0 (a few KiB per rank, in the checkpoint
file). A save is taken at an optimizer-step boundary (:class:`lit_minimind.callbacks.ResumeCallback`), where no
gradient is pending: the RNG is all that differs between ranks. Checkpoints written before (formats 1 and 2)
may list partial gradients; they are not read (a resume from one inside an accumulation window says so and
restarts that window's gradients, as MiniMind's own resume does).

**A loss scale across precision plugins** (:func:`lit_minimind.resume.internals.adopt_scaler_state`): a checkpoint written under one (the CPU
fp16 plugin, :class:`lit_minimind.model.precision.CPUFloat16Mixed`) resumes under another (Lightning's CUDA
``MixedPrecision("16-mixed", "cuda")``) with its scale, and back. Lightning keeps a precision plugin's state
under the plugin's class name, so a run with another plugin would start again from the initial scale.
``torch.amp.GradScaler``'s state dict holds no device: the same dict loads into a CPU or a CUDA scaler.

**The loggers' runs** (:class:`WandbRun`, a part of :class:`lit_minimind.resume.manager.CheckpointManager`): the
wandb run a resumed run continues. **The library versions** a checkpoint was written with (:func:`library_versions`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lit_minimind.checkpoint.names import TRAINING_STATE_FORMAT
from lit_minimind.errors import PositionError

# ----------------------------------------------------------------------------- the data position

def corrected_step(step: int, saved_world_size: int, current_world_size: int) -> int:
    """MiniMind's world-size step correction: ``step * saved // current``."""
    return step * saved_world_size // current_world_size


def world_size_change(saved_step: int, saved_world_size: int, world_size: int, step: int) -> str | None:
    """The line a resume prints when the world size changed (``None`` when it did not)."""
    if saved_world_size == world_size:
        return None
    return f"world size changed ({saved_world_size}→{world_size}): step {saved_step} → {step}"


@dataclass(frozen=True)
class DataPosition:
    """``step`` batches of 0-based ``epoch`` trained on this rank, of ``iters`` per epoch."""

    epoch: int
    step: int
    iters: int

    @property
    def epoch_complete(self) -> bool:
        return self.step >= self.iters

    def next_batch(self) -> tuple[int, int]:
        """``(epoch, batches to skip in it)`` of the first batch still to train."""
        return (self.epoch + 1, 0) if self.epoch_complete else (self.epoch, self.step)

    def describe(self) -> str:
        epoch, skip = self.next_batch()
        if skip:
            return f"resuming epoch {epoch + 1} at step {skip + 1}/{self.iters}: skipping {skip} trained batches"
        return f"resuming at the start of epoch {epoch + 1}"


def position_here(saved: Mapping[str, Any], world_size: int, iters: int, saved_iters: int) -> DataPosition:
    """The saved ``{"epoch", "step", "world_size"}`` as a position on ``world_size`` ranks.

    ``iters`` is the epoch length here, ``saved_iters`` the one the checkpoint was written with.
    A finished epoch stays finished whatever its length on this world size.
    """
    epoch, step = int(saved["epoch"]), int(saved["step"])
    saved_world = int(saved.get("world_size") or 1)
    if step >= saved_iters:
        return DataPosition(epoch, iters, iters)
    if saved_world == world_size and step > iters:
        raise PositionError(f"checkpoint is at step {step} of epoch {epoch + 1}, but an epoch has only {iters} batches here")
    return DataPosition(epoch, min(corrected_step(step, saved_world, world_size), iters), iters)


def window_complete(step: int, iters: int, accumulate: int) -> bool:
    """After batch ``step`` (1-based) of an epoch of ``iters``, the optimizer has stepped: MiniMind's
    ``step % accumulation_steps == 0``, and Lightning's flush at the epoch's last batch."""
    return step % accumulate == 0 or step == iters


def optimizer_steps(position: DataPosition, accumulate: int) -> int:
    """Optimizer steps taken once ``position`` is reached (one per window; a short last window counts)."""
    per_epoch = -(-position.iters // accumulate)
    in_epoch = position.step // accumulate + (1 if position.epoch_complete and position.step % accumulate else 0)
    return position.epoch * per_epoch + in_epoch


# ----------------------------------------------------------------------------- each rank's RNG

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


def save_rank_states(trainer: Any) -> dict[str, Any]:
    """The checkpoint's ``lit_minimind`` entry, on global rank 0 (``{}`` elsewhere): every rank's RNG in
    rank order. Every rank must call it (under DDP it runs one collective)."""
    world = trainer.world_size
    mine = {"rng": rng_state()}
    if world == 1 or not dist.is_initialized():
        states = [mine]
    else:
        states = [None] * world if trainer.is_global_zero else None
        dist.gather_object(mine, states, dst=0)
        if not trainer.is_global_zero:
            return {}
    return {"format": TRAINING_STATE_FORMAT, "world_size": world, "ranks": [{"rng": s["rng"]} for s in states]}


def rank_rng_state(state: Mapping[str, Any], rank: int) -> Any:
    """This rank's saved RNG state, or None for a rank the saving run did not have (it keeps its own
    stream, seeded seed + rank)."""
    ranks = state.get("ranks") or []
    return ranks[rank].get("rng") if rank < len(ranks) else None


def library_versions() -> dict[str, str]:
    """The versions a checkpoint is written with (lit-minimind's as pip installed it: ``lit_minimind.__version__``)."""
    import platform

    import lightning

    package = sys.modules["lit_minimind"]  # the package root: imported before any of its modules
    return {"lit_minimind": package.__version__, "torch": str(torch.__version__), "lightning": str(lightning.__version__),
            "python": platform.python_version()}


# ----------------------------------------------------------------------------- the loggers' runs

def wandb_logger(trainer: Any) -> Any:
    """The trainer's WandbLogger, if any."""
    from lightning.pytorch.loggers import WandbLogger

    return next((lg for lg in trainer.loggers if isinstance(lg, WandbLogger)), None)


def continue_wandb_run(trainer: Any, run_id: str | None) -> None:
    """Before the run starts: make a WandbLogger continue the checkpoint's run, unless the user chose an id.

    wandb reads ``WANDB_RUN_ID`` when no id is passed (WandbLogger already passes ``resume="allow"``).
    """
    from lightning.pytorch.utilities import rank_zero_info  # here: the course API (this module) never loads Lightning

    logger = wandb_logger(trainer)
    if logger is None:
        return
    chosen = logger.version  # the id given to the logger (None until the run starts, if none was)
    if chosen and chosen != run_id:
        rank_zero_info(f"wandb: logging to the run id you chose ({chosen}), not the checkpoint's ({run_id})")
    elif run_id is None:
        rank_zero_info("wandb: the checkpoint has no wandb run id: starting a new run (its id goes into the next checkpoint)")
    else:
        os.environ["WANDB_RUN_ID"] = run_id
        rank_zero_info(f"wandb: continuing run {run_id}")


def wandb_run_id(trainer: Any) -> str | None:
    logger = wandb_logger(trainer)
    return str(logger.experiment.id) if logger is not None and trainer.is_global_zero else None


def resume_record(trainer: Any, resumed_from: dict[str, Any]) -> dict[str, Any]:
    """``{"resume_at_global_step_N": where this run resumed from}``, for the run's config."""
    record = {**resumed_from, "checkpoint": str(trainer.ckpt_path), "world_size_now": trainer.world_size}
    return {f"resume_at_global_step_{resumed_from['global_step']}": record}


def describe_wandb_run(trainer: Any, resume_records: dict[str, Any]) -> str | None:
    """One step axis for every metric (``micro_step``) and every resume of the run so far in its config
    (all of them each time: a process SIGKILLed before wandb wrote its config loses none). Returns the run id."""
    logger = wandb_logger(trainer)
    if logger is None or not trainer.is_global_zero:
        return None
    run = logger.experiment
    run.define_metric("micro_step")
    run.define_metric("*", step_metric="micro_step")
    if resume_records:
        run.config.update(dict(resume_records), allow_val_change=True)
    return str(run.id)


class WandbRun:
    """A part: the wandb run a resumed run keeps logging into, by the saved run id (the checkpoint's
    ``callbacks.ResumeCallback.wandb_id`` and MiniMind's ``wandb_id`` key). Without a WandbLogger it keeps
    the id a checkpoint brought (a resume with wandb later continues that run)."""

    def __init__(self) -> None:
        self.id: str | None = None

    def state_dict(self) -> str | None:
        return self.id

    def load_state_dict(self, state: str | None) -> None:
        self.id = state

    def at_start(self, trainer: Any, saved_id: str | None) -> None:
        """Before the loggers start (the start was chosen): continue the checkpoint's run."""
        continue_wandb_run(trainer, saved_id)

    def at_train_start(self, trainer: Any, resume_records: dict[str, Any]) -> None:
        """The run exists: its step axis and resumes described, its id taken."""
        self.id = describe_wandb_run(trainer, resume_records) or self.id

    def at_save(self, trainer: Any) -> None:
        self.id = wandb_run_id(trainer) or self.id
