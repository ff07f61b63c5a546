"""Where training stands in the data, and how a saved position maps onto another world size.

MiniMind's rule (lesson 15): ``step`` counts the batches of an epoch on one rank, so a run saved
on ``W`` ranks resumes on ``W'`` ranks at ``step * W // W'``. Because every rank's samples come from
one world-size independent permutation (:class:`lit_minimind.data.sampler.EpochShardSampler`), those
batches cover exactly the samples already trained. This module is the only place with that rule.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lit_minimind.errors import PositionError


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
