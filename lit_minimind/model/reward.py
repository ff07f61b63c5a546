"""A reward model of MiniMind's architecture, trained on preference pairs (Bradley-Terry).

MiniMind's RL stages score answers with InternLM2-1.8B-Reward (a download larger than the policy);
this is the same role at MiniMind's size: the MiniMind backbone with a scalar head, as MiniMind's PPO
critic (``trainer/train_ppo.py``: ``value_head(model.norm(h))``), read at the last token of the
conversation. On DPO batches the loss is ``-log sigmoid(r_chosen - r_rejected)``; the statistics are
the pairwise accuracy (chosen scored higher), the margin and each side's mean score.

Its state dict is MiniMind's model's plus ``value_head.weight`` and ``value_head.bias``, so MiniMind's
loaders (``strict=False``) read its backbone, and :class:`RewardScorer` (the RL stage's
``--reward_model``) reads the whole.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lit_minimind.model.minimind import MiniMindConfig, MiniMindForCausalLM

__all__ = ["RewardModel", "bradley_terry_loss", "last_token_index"]


class RewardModel(MiniMindForCausalLM):
    """MiniMind's causal LM with a scalar head: :meth:`scores` gives one value per position."""

    def __init__(self, config: MiniMindConfig) -> None:
        super().__init__(config)
        self.value_head = nn.Linear(config.hidden_size, 1)

    def scores(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(B, T)`` values (MiniMind's critic: ``value_head(model.norm(hidden))``) and the MoE aux loss."""
        hidden, _, aux_loss = self.model(input_ids)
        return self.value_head(self.model.norm(hidden)).squeeze(-1), aux_loss


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Per row, the index in the unshifted sequence of the last answer token: DPO's ``mask`` is over the
    targets ``y = ids[1:]``, so the last 1 at ``i`` is token ``i + 1`` (no host sync)."""
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    return (positions * mask).argmax(dim=1) + 1


def bradley_terry_loss(model: RewardModel, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``-log sigmoid(r_c - r_r)`` (mean over the pairs) + the MoE aux loss of one forward over both sides;
    returns the loss and its statistics (detached)."""
    ids = torch.cat([torch.cat([batch[f"x_{s}"][:, :1], batch[f"y_{s}"]], dim=1) for s in ("chosen", "rejected")])
    mask = torch.cat([batch["mask_chosen"], batch["mask_rejected"]])
    values, aux_loss = model.scores(ids)
    rewards = values.gather(1, last_token_index(mask).unsqueeze(1)).squeeze(1).float()
    half = rewards.shape[0] // 2
    chosen, rejected = rewards[:half], rewards[half:]
    bt = -F.logsigmoid(chosen - rejected).mean()
    loss = bt + aux_loss
    with torch.no_grad():
        stats = {"loss": loss.detach(), "reward_loss": bt.detach(), "aux_loss": aux_loss.detach(),
                 "rewards/chosen": chosen.mean(), "rewards/rejected": rejected.mean(),
                 "rewards/accuracy": (chosen > rejected).float().mean(), "rewards/margin": (chosen - rejected).mean()}
    return loss, stats
