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

**A loss scale across precision plugins** (:func:`adopt_scaler_state`): a checkpoint written under one (the CPU
fp16 plugin, :class:`lit_minimind.model.precision.CPUFloat16Mixed`) resumes under another (Lightning's CUDA
``MixedPrecision("16-mixed", "cuda")``) with its scale, and back. Lightning keeps a precision plugin's state
under the plugin's class name, so a run with another plugin would start again from the initial scale.
``torch.amp.GradScaler``'s state dict holds no device: the same dict loads into a CPU or a CUDA scaler.
"""

from __future__ import annotations

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


# ----------------------------------------------------------------------------- a loss scale across precision plugins

def adopt_scaler_state(checkpoint: dict[str, Any], plugin: Any) -> None:
    """Before Lightning restores the precision plugin: when ``plugin`` has a scaler and ``checkpoint``
    holds no state under its class name, give it the saved scaler state (MiniMind's ``scaler`` key,
    which every lit-minimind checkpoint carries), for Lightning to load with ``plugin.load_state_dict``."""
    key = type(plugin).__qualname__
    saved = checkpoint.get("scaler")
    if saved and key not in checkpoint and getattr(plugin, "scaler", None) is not None:
        checkpoint[key] = dict(saved)
