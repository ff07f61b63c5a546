"""MiniMind's DPO objective (``trainer/train_dpo.py``) and its frozen reference model.

A DPO batch holds ``x_chosen, y_chosen, mask_chosen, x_rejected, y_rejected, mask_rejected``
(:class:`lit_minimind.data.dpo.DPODataset`); chosen and rejected are concatenated into one batch,
so the policy and the reference each cost one forward. With per-sequence log-probabilities summed
over the answer tokens (``mask``), the loss is MiniMind's
``-log sigmoid(beta * ((pi_c - pi_r) - (ref_c - ref_r)))`` averaged over the pairs; the MoE aux loss
of the policy is added by the caller. Beside MiniMind's numbers :func:`dpo_loss` returns what
preference trainers log: the implicit rewards ``beta * (pi - ref)`` of each side, their margin and
the fraction of pairs whose chosen reward is higher (reward accuracy).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["DPO_BETA", "Reference", "dpo_inputs", "dpo_loss", "file_sha256", "token_log_probs"]

DPO_BETA = 0.15  # MiniMind's --beta


def dpo_inputs(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x, y, mask)``: the chosen rows, then the rejected rows (MiniMind's ``torch.cat``)."""
    return tuple(torch.cat([batch[f"{k}_chosen"], batch[f"{k}_rejected"]], dim=0) for k in ("x", "y", "mask"))


def token_log_probs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``log p(label)`` at every position (MiniMind's ``logits_to_log_probs``)."""
    return torch.gather(F.log_softmax(logits, dim=2), dim=2, index=labels.unsqueeze(2)).squeeze(-1)


def dpo_loss(policy_log_probs: torch.Tensor, ref_log_probs: torch.Tensor, mask: torch.Tensor,
             beta: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """MiniMind's ``dpo_loss`` on token log-probs ``(2B, T)`` (chosen rows first); returns the loss
    and the rewards' statistics (detached: chosen, rejected, accuracy, margin, each a mean)."""
    policy = (policy_log_probs * mask).sum(dim=1)
    ref = (ref_log_probs * mask).sum(dim=1)
    half = ref.shape[0] // 2
    logits = (policy[:half] - policy[half:]) - (ref[:half] - ref[half:])
    loss = -F.logsigmoid(beta * logits).mean()
    with torch.no_grad():
        chosen, rejected = beta * (policy[:half] - ref[:half]), beta * (policy[half:] - ref[half:])
        stats = {"rewards/chosen": chosen.mean(), "rewards/rejected": rejected.mean(),
                 "rewards/accuracy": (chosen > rejected).float().mean(), "rewards/margin": (chosen - rejected).mean()}
    return loss, stats


def file_sha256(path: str | os.PathLike[str]) -> str:
    """The sha256 of a file's bytes, or of a directory's files in name order (a Hugging Face directory):
    the start weights and teachers recorded in checkpoints."""
    path = Path(path)
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    digest = hashlib.sha256()
    for file in files:
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


class Reference:
    """A frozen model (DPO's reference, distillation's teacher), held outside the LightningModule's modules on purpose: it is not a
    parameter or buffer of the module, so it is in no checkpoint or optimizer, DDP neither wraps nor
    broadcasts it, and it never has gradients. It follows the policy's device and dtype on use."""

    def __init__(self, model: nn.Module, path: str | os.PathLike[str], sha256: str) -> None:
        self.model = model.eval().requires_grad_(False)
        self.path, self.sha256 = Path(path), sha256

    @torch.no_grad()
    def logits(self, x: torch.Tensor, like: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The model's logits for ``x``, one forward without gradients; ``like`` is a trained parameter
        whose device and dtype the frozen model takes."""
        first = next(self.model.parameters())
        if first.device != like.device or first.dtype != like.dtype:
            self.model.to(device=like.device, dtype=like.dtype)
        return self.model(x, attention_mask=attention_mask).logits

    def log_probs(self, x: torch.Tensor, y: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """Token log-probs of ``y`` given ``x`` (no gradients)."""
        return token_log_probs(self.logits(x, like), y)
