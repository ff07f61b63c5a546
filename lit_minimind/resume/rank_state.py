"""Each rank's own training state for a checkpoint: its RNG, gathered on global rank 0 (a few KiB per
rank, kept in the checkpoint file).

A save is taken at an optimizer-step boundary (:class:`lit_minimind.callbacks.ResumeCallback`), where
no gradient is pending: the RNG is all that differs between ranks. Checkpoints written before (formats
1 and 2) may list partial gradients; they are not read (a resume from one inside an accumulation
window says so and restarts that window's gradients, as MiniMind's own resume does).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from lit_minimind.checkpoint.names import TRAINING_STATE_FORMAT
from lit_minimind.resume.rng import rng_state


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


def saved_partial_gradients(state: Mapping[str, Any]) -> bool:
    """A checkpoint written inside an accumulation window by an earlier version (formats 1 and 2) lists
    partial gradients (inline, or in per-rank shard files)."""
    return bool(state.get("shards")) or any(r.get("grads") for r in state.get("ranks") or [] if isinstance(r, Mapping))


def rank_rng_state(state: Mapping[str, Any], rank: int) -> Any:
    """This rank's saved RNG state, or None for a rank the saving run did not have (it keeps its own
    stream, seeded seed + rank)."""
    ranks = state.get("ranks") or []
    return ranks[rank].get("rng") if rank < len(ranks) else None
