"""Each rank's own training state for a checkpoint: its RNG, gathered on global rank 0 (a few KiB per
rank, kept in the checkpoint file), and, inside an accumulation window, its partial gradients, which
each rank writes into its own shard beside the checkpoint (``{checkpoint}.rank{r}.grads``,
:func:`lit_minimind.checkpoint.names.shard_path`) and reads back alone on resume.

A shard is ``{"grads": {name: gradient}, "rank", "world_size"}``, the gradients unscaled (divided by
the loss scale, so a resume under another precision or scale applies them correctly) and written
parameter by parameter, straight from the parameters' ``.grad`` when there is no loss scale: a rank
holds at most one extra copy of its own gradients while it writes (CUDA ones are copied to the host a
parameter at a time). The shards are written synchronously on every rank, with the atomic writer,
before the small gather; rank 0 then lists each shard with its size and CRC-32 in the checkpoint and
its manifest, so the checkpoint is committed only after every shard is durable.

Checkpoints of format 1 (written before the shards) carry every rank's gradients inline, in
``ranks[r]["grads"]``; :func:`rank_training_state` still reads them.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lit_minimind.checkpoint.atomic import atomic_save
from lit_minimind.checkpoint.names import SHARDS_FIELD, TRAINING_STATE_FORMAT, shard_path
from lit_minimind.checkpoint.read import read_shard
from lit_minimind.errors import CheckpointError
from lit_minimind.resume.rng import rng_state


def trainable(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters that take gradients, in parameter order (the same on every rank)."""
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad]


def unscaled_gradients(module: torch.nn.Module, scale: float) -> dict[str, torch.Tensor]:
    """``{name: gradient / scale}`` of every trainable parameter that has one; the gradients
    themselves (no copy) when ``scale`` is 1."""
    return {name: (p.grad.detach() if scale == 1.0 else p.grad.detach() / scale)
            for name, p in trainable(module) if p.grad is not None}


def write_shard(checkpoint: str | Path, rank: int, world_size: int, module: torch.nn.Module,
                scale: float) -> dict[str, Any]:
    """This rank's partial gradients into its shard of ``checkpoint`` (atomic, fsynced); its entry
    for the checkpoint's list (``file``, ``rank``, ``size``, ``crc32``), or ``{"rank", "error"}`` when
    the write failed (the checkpoint must then not be committed)."""
    path = shard_path(checkpoint, rank)
    try:
        saved = atomic_save({"grads": unscaled_gradients(module, scale), "rank": rank, "world_size": world_size},
                            path, {"kind": "grad_shard", "rank": rank})
    except OSError as err:
        return {"rank": rank, "error": f"{path}: {err}"}
    return {"file": path.name, "rank": rank, "size": saved["size"], "crc32": saved["crc32"]}


def save_rank_states(trainer: Any, module: torch.nn.Module, partial: bool, scale: float,
                     checkpoint: str | Path | None) -> dict[str, Any]:
    """The checkpoint's ``lit_minimind`` entry, on global rank 0 (``{}`` elsewhere): every rank's RNG in
    rank order and, when ``partial`` (inside an accumulation window) and the checkpoint's path is
    known, each rank's shard entry (every rank wrote its shard before the gather). Every rank must
    call it, at a step boundary (it runs one collective)."""
    world, rank = trainer.world_size, trainer.global_rank
    shard = write_shard(checkpoint, rank, world, module, scale) if partial and checkpoint is not None else None
    mine = {"rng": rng_state(), "shard": shard}
    if world == 1 or not dist.is_initialized():
        states = [mine]
    else:
        states = [None] * world if trainer.is_global_zero else None
        dist.gather_object(mine, states, dst=0)  # after every rank's shard is on disk
        if not trainer.is_global_zero:
            return {}
    shards = [s["shard"] for s in states] if partial and checkpoint is not None else None
    return {"format": TRAINING_STATE_FORMAT, "world_size": world, "ranks": [{"rng": s["rng"]} for s in states],
            SHARDS_FIELD: shards}


def shard_errors(state: Mapping[str, Any]) -> list[str]:
    """Why some rank could not write its shard (``[]``: every shard is on disk)."""
    return [s["error"] for s in state.get(SHARDS_FIELD) or [] if isinstance(s, dict) and "error" in s]


class GradShard:
    """A rank's partial gradients in a shard beside ``checkpoint``, read only when applied."""

    def __init__(self, checkpoint: str | Path, entry: Mapping[str, Any]) -> None:
        self.checkpoint, self.entry = Path(checkpoint), dict(entry)

    def load(self) -> dict[str, torch.Tensor]:
        """The shard's gradients, its bytes checked against the checkpoint's record first."""
        grads = read_shard(self.checkpoint, self.entry).get("grads")
        if not isinstance(grads, dict):
            raise CheckpointError(f"{self.checkpoint}: its shard {self.entry.get('file')} holds no gradients")
        return grads


def rank_training_state(state: Mapping[str, Any], rank: int, checkpoint: str | Path | None) -> dict[str, Any]:
    """This rank's ``{"rng", "grads"}`` from a checkpoint's ``lit_minimind`` entry: ``grads`` a
    :class:`GradShard` (format 2), the gradients themselves (format 1) or None; ``{}`` for a rank the
    saving run did not have."""
    ranks = state.get("ranks") or []
    if rank >= len(ranks):
        return {}
    mine = {"rng": ranks[rank].get("rng"), "grads": ranks[rank].get("grads")}  # format 1: gradients inline
    shards = state.get(SHARDS_FIELD) or []
    if rank < len(shards) and shards[rank]:
        if checkpoint is None:
            raise CheckpointError("a checkpoint saved inside an accumulation window was loaded without its path: "
                                  "its partial-gradient shards cannot be found")
        mine["grads"] = GradShard(checkpoint, shards[rank])
    return mine


def apply_gradients(module: torch.nn.Module, grads: GradShard | Mapping[str, torch.Tensor], scale: float) -> None:
    """Set the parameters' gradients to the saved ones times ``scale`` (the loss scale of this run).
    A shard's tensors are scaled in place and handed over (no second copy on the CPU)."""
    loaded = grads.load() if isinstance(grads, GradShard) else grads
    params = dict(module.named_parameters())
    for name in list(loaded):
        grad = loaded[name]
        grad = grad.mul_(scale) if isinstance(grads, GradShard) else grad * scale
        params[name].grad = grad.to(device=params[name].device, dtype=params[name].dtype)
        if isinstance(grads, GradShard):
            del loaded[name]  # the device copy is the parameter's now
