"""MiniMind's LoRA (``model/model_lora.py``): low-rank adapters on every square ``nn.Linear``.

An adapter is ``lora`` = ``B(A(x))`` (``A``: in -> rank, ``B``: rank -> out, no bias), attached to
its Linear as the child module ``lora`` (so the keys are MiniMind's: ``….q_proj.lora.A.weight``)
and added to the Linear's output by a forward hook (MiniMind replaces ``forward``; same sum).
``A`` is drawn from N(0, 0.02) and ``B`` is zero, drawing from the global generator in MiniMind's
order (per adapter: ``A``'s and ``B``'s default Linear init, then ``A``'s normal), so with the same
seed the adapters are MiniMind's. In MiniMind's model the square Linears are each layer's
``q_proj`` and ``o_proj``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from lit_minimind.checkpoint.names import LORA_KEY

__all__ = ["LORA_RANK", "LoRA", "apply_lora", "attach_lora", "freeze_base", "is_lora_key", "lora_state", "load_lora", "merged_state"]

LORA_RANK = 16  # MiniMind's apply_lora(model, rank=16)


class LoRA(nn.Module):
    """``B(A(x))``: ``A`` (rank x in) ~ N(0, 0.02), ``B`` (out x rank) zero."""

    def __init__(self, in_features: int, out_features: int, rank: int) -> None:
        super().__init__()
        self.rank = rank
        self.A = nn.Linear(in_features, rank, bias=False)
        self.B = nn.Linear(rank, out_features, bias=False)
        with torch.no_grad():
            self.A.weight.normal_(mean=0.0, std=0.02)
            self.B.weight.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.B(self.A(x))


def _add_lora(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    """Forward hook: the Linear's output plus its adapter's (MiniMind's ``layer1(x) + layer2(x)``)."""
    return output + module.lora(args[0])


def apply_lora(model: nn.Module, rank: int = LORA_RANK) -> list[str]:
    """Attach an adapter to every square ``nn.Linear`` of ``model`` (in ``named_modules`` order);
    returns their names. Adapters live on the Linear's device and dtype."""
    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}")
    targets = [(name, m) for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and m.in_features == m.out_features and LORA_KEY not in f".{name}."]
    for _, linear in targets:
        linear.lora = LoRA(linear.in_features, linear.out_features, rank).to(linear.weight.device)
        linear.register_forward_hook(_add_lora)
    return [name for name, _ in targets]


def is_lora_key(key: str) -> bool:
    return LORA_KEY in key  # (lit_minimind.checkpoint.names: the file format's name for an adapter's keys)


def freeze_base(model: nn.Module) -> list[nn.Parameter]:
    """Only the adapters train (MiniMind: ``'lora' in name``); returns them in ``named_parameters`` order."""
    trainable = []
    for name, param in model.named_parameters():
        param.requires_grad = is_lora_key(f".{name}")
        if param.requires_grad:
            trainable.append(param)
    return trainable


def lora_state(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter tensors of a state dict as MiniMind's ``save_lora`` writes them: fp16, on the CPU,
    keys without a ``module.`` prefix."""
    return {(k[7:] if k.startswith("module.") else k): v.detach().half().cpu()
            for k, v in state_dict.items() if is_lora_key(k)}


def load_lora(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> int:
    """MiniMind's ``load_lora``: copy each adapter's tensors (any dtype; ``module.`` prefixes dropped)
    into ``model``'s adapters (strict per adapter). Returns the number of adapters loaded."""
    state = {(k[7:] if k.startswith("module.") else k): v for k, v in state_dict.items()}
    loaded = 0
    for name, module in model.named_modules():
        if isinstance(getattr(module, "lora", None), LoRA):
            prefix = f"{name}.lora."
            module.lora.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
            loaded += 1
    return loaded


def merged_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """MiniMind's ``merge_lora``: the model's weights in fp16 without the adapters, each adapted
    Linear's weight plus ``B @ A`` (added in fp16, as MiniMind)."""
    state = {k: v.detach().cpu().half() for k, v in model.state_dict().items() if not is_lora_key(k)}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and not is_lora_key(f".{name}."):
            weight = module.weight.detach().clone().cpu().half()
            if isinstance(getattr(module, "lora", None), LoRA):
                weight += (module.lora.B.weight.detach() @ module.lora.A.weight.detach()).cpu().half()
            state[f"{name}.weight"] = weight
    return state


def attach_lora(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> int:
    """Give ``model`` the adapters of ``state_dict`` (a LoRA export, or any state dict holding adapter
    tensors): their rank is read from the tensors; returns the number of adapters loaded. Raises
    ``ValueError`` when ``state_dict`` holds no adapter."""
    ranks = {int(v.shape[0]) for k, v in state_dict.items() if is_lora_key(k) and k.endswith(".lora.A.weight")}
    if not ranks:
        raise ValueError("no LoRA adapter tensors (keys '….lora.A.weight') in it")
    if len(ranks) > 1:
        raise ValueError(f"adapters of several ranks {sorted(ranks)}")
    with torch.random.fork_rng(devices=[]):  # the adapters' init is overwritten: draw nothing from the caller's stream
        apply_lora(model, ranks.pop())
    return load_lora(model, {k: v for k, v in state_dict.items() if is_lora_key(k)})
