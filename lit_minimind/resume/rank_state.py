"""Each rank's own training state for a checkpoint: its RNG and, inside an accumulation window, its
partial gradients, collected on global rank 0 (the rank that writes).

The gradients travel as one flat tensor per rank, point to point (``send``/``recv``), never
pickled: a rank other than 0 holds one copy of its gradients while it is sent, rank 0 its own and
the other ranks' (with NCCL one receive buffer on the device, reused; gloo sends CPU copies). Saved unscaled, so a
resume under another precision or loss scale applies them correctly.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lit_minimind.resume.rng import rng_state


def trainable(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters that take gradients, in parameter order (the same on every rank)."""
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad]


def flat_partial_gradients(module: torch.nn.Module, scale: float) -> tuple[torch.Tensor, list[bool]]:
    """Every trainable parameter's gradient divided by ``scale``, concatenated in parameter order
    (zeros where a parameter has none), and which parameters had one."""
    params = [p for _, p in trainable(module)]
    present = [p.grad is not None for p in params]
    parts = [(p.grad.detach() if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
    flat = torch.cat(parts) if parts else torch.zeros(0)
    return flat.div_(scale), present


def named_gradients(module: torch.nn.Module, flat: torch.Tensor, present: list[bool]) -> dict[str, torch.Tensor]:
    """``{name: gradient}`` as views into ``flat`` (one storage: written once)."""
    grads, offset = {}, 0
    for (name, param), has in zip(trainable(module), present):
        n = param.numel()
        if has:
            grads[name] = flat[offset:offset + n].view(param.shape)
        offset += n
    return grads


def gather_rank_states(trainer: Any, module: torch.nn.Module, partial: bool, scale: float) -> list[dict[str, Any]]:
    """``[{"rng", "grads"}]`` of every rank, in rank order, on global rank 0 (``[]`` elsewhere);
    ``grads`` is None when ``partial`` is false (the window is complete). Every rank must call it."""
    flat, present = flat_partial_gradients(module, scale) if partial else (None, None)
    mine = {"rng": rng_state(), "present": present}
    world = trainer.world_size
    if world == 1 or not dist.is_initialized():
        return [_state(module, mine, flat.cpu() if flat is not None else None)]
    if flat is not None and dist.get_backend() == "gloo":
        flat = flat.cpu()  # gloo sends CPU tensors (CUDA ones only through NCCL)
    small: list[Any] | None = [None] * world if trainer.is_global_zero else None
    dist.gather_object(mine, small, dst=0)  # RNG states and masks: a few KiB per rank
    if not trainer.is_global_zero:
        if flat is not None:
            dist.send(flat, dst=0)
        return []
    states = [_state(module, small[0], flat.cpu() if flat is not None else None)]
    buffer = torch.empty_like(flat) if flat is not None and flat.device.type != "cpu" else None
    for rank in range(1, world):
        received = None
        if flat is not None:
            target = buffer if buffer is not None else torch.empty_like(flat)
            dist.recv(target, src=rank)
            received = target.cpu() if buffer is not None else target
        states.append(_state(module, small[rank], received))
    return states


def _state(module: torch.nn.Module, small: dict[str, Any], flat: torch.Tensor | None) -> dict[str, Any]:
    grads = named_gradients(module, flat, small["present"]) if flat is not None else None
    return {"rng": small["rng"], "grads": grads}
