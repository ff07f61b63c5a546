"""MiniMind's causal LM as a LightningModule: MiniMind's loss, optimizer and LR rule."""

from __future__ import annotations

import math
import os
import random
from typing import Any

import lightning as L
import torch

from lit_minimind.checkpoint.weights import config_mismatches, shape_config
from lit_minimind.data.sampler import MINIMIND_SEED
from lit_minimind.errors import CheckpointError
from lit_minimind.model import MiniMindConfig, MiniMindForCausalLM


def minimind_lr(step: int, total_steps: int, learning_rate: float, warmup_steps: int = 0) -> float:
    """MiniMind's cosine rule ``lr * (0.1 + 0.45 * (1 + cos(pi * t / T)))``.

    ``t`` is the 1-based micro-batch index ``epoch * iters + step``, ``T = epochs * iters``.
    With ``warmup_steps > 0`` (not MiniMind's default) the first micro-batches ramp linearly.
    """
    lr = learning_rate * (0.1 + 0.45 * (1 + math.cos(math.pi * step / total_steps)))
    if warmup_steps > 0 and step < warmup_steps:
        lr *= step / warmup_steps
    return lr


def seed_rank(seed: int) -> None:
    """MiniMind's ``setup_seed``: Python's, NumPy's and torch's (CPU and CUDA) generators."""
    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # every CUDA device too


class LitMiniMind(L.LightningModule):
    """Pretraining MiniMind: loss = CE + MoE aux loss, AdamW, LR set per micro-batch as MiniMind does.

    Args:
        hidden_size, num_hidden_layers, use_moe, num_attention_heads, num_key_value_heads,
        vocab_size, num_experts, num_experts_per_tok, dropout: :class:`MiniMindConfig` fields.
        learning_rate: peak LR of MiniMind's cosine rule.
        warmup_steps: linear warmup in micro-batches (0 = MiniMind).
        weight_decay: AdamW weight decay (torch's default 0.01, as MiniMind).
        compile: ``torch.compile`` the model's forward (MiniMind's ``--use_compile 1``); its state dict,
            and so every checkpoint, keeps MiniMind's keys.
    """

    def __init__(
        self,
        hidden_size: int = 768,
        num_hidden_layers: int = 8,
        use_moe: bool = False,
        num_attention_heads: int = 8,
        num_key_value_heads: int = 4,
        vocab_size: int = 6400,
        num_experts: int = 4,
        num_experts_per_tok: int = 1,
        dropout: float = 0.0,
        learning_rate: float = 5e-4,
        warmup_steps: int = 0,
        weight_decay: float = 0.01,
        compile: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.config = MiniMindConfig(
            hidden_size=hidden_size,
            num_hidden_layers=num_hidden_layers,
            use_moe=use_moe,
            num_attention_heads=num_attention_heads,
            num_key_value_heads=num_key_value_heads,
            vocab_size=vocab_size,
            num_experts=num_experts,
            num_experts_per_tok=num_experts_per_tok,
            dropout=dropout,
        )
        self.model = MiniMindForCausalLM(self.config)
        # as MiniMind: DDP leaves the RoPE tables alone (constants on every rank, not state to broadcast)
        self._ddp_params_and_buffers_to_ignore = [n for n, _ in self.named_buffers() if n.endswith(("freqs_cos", "freqs_sin"))]
        if compile:
            self.model.compile()  # in place: no ``_orig_mod.`` wrapper, state dict keys unchanged
        self.epoch_loss = torch.zeros(2)  # running (sum, count) of this epoch's losses: no host sync per batch
        self.last_stats: dict[str, torch.Tensor] = {}

    def setup(self, stage: str) -> None:
        """Under DDP, rank ``r > 0`` draws (dropout) from its own stream seeded ``seed + r``, as MiniMind's
        ``setup_seed(42 + rank)``; rank 0 keeps the stream seeded before the model was built (the weights
        are rank 0's on every rank: DDP broadcasts them). A resume then restores each rank's own state."""
        rank = self.trainer.global_rank
        if rank > 0:
            seed_rank(int(os.environ.get("PL_GLOBAL_SEED", MINIMIND_SEED)) + rank)  # Lightning's seed_everything sets it

    # ----------------------------------------------------------------- schedule
    def total_lr_steps(self) -> int:
        """``T`` of the LR rule: epochs x batches per epoch (micro-batches), or max_steps x accumulation."""
        trainer = self.trainer
        iters = int(trainer.num_training_batches)
        total = (trainer.max_epochs or 1) * iters if trainer.max_epochs and trainer.max_epochs > 0 else math.inf
        if trainer.max_steps and trainer.max_steps > 0:
            total = min(total, trainer.max_steps * trainer.accumulate_grad_batches)
        return max(1, int(total))

    def lr_at(self, epoch: int, step: int) -> float:
        """LR for the ``step``-th (1-based) micro-batch of ``epoch``."""
        iters = int(self.trainer.num_training_batches)
        return minimind_lr(epoch * iters + step, self.total_lr_steps(), self.hparams.learning_rate, self.hparams.warmup_steps)

    # ----------------------------------------------------------------- training
    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None):
        return self.model(input_ids, labels=labels)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        input_ids, labels = batch
        lr = self.lr_at(self.current_epoch, batch_idx + 1)
        for group in self.optimizers().param_groups:
            group["lr"] = lr
        out = self.model(input_ids, labels=labels)
        loss = out.loss + out.aux_loss
        self.last_stats = {"loss": loss.detach(), "logits_loss": out.loss.detach(), "aux_loss": out.aux_loss.detach(), "lr": lr}
        self.epoch_loss = self.epoch_loss.to(loss.device) + torch.stack([loss.detach().float(), loss.new_ones(()).float()])
        # per-micro-batch metrics go to the loggers from callbacks.MiniMindConsole, batched at its
        # log interval (Lightning's self.log would turn them into numbers, a host sync, every batch)
        return loss

    def on_train_epoch_start(self) -> None:
        restored, self._restored_epoch_loss = getattr(self, "_restored_epoch_loss", None), None
        if restored is not None and restored["epoch"] == self.current_epoch:  # resumed inside this epoch
            self.epoch_loss = restored["sum_count"].to(self.device)
        else:
            self.epoch_loss = torch.zeros(2, device=self.device)

    def on_train_epoch_end(self) -> None:
        total, count = self.epoch_loss
        if count > 0:  # one host sync per epoch
            self.log("mean_loss", total / count, prog_bar=True, sync_dist=True)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        input_ids, labels = batch
        out = self.model(input_ids, labels=labels)
        self.log("val_loss", out.loss, on_epoch=True, prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.model.parameters(), lr=self.hparams.learning_rate, weight_decay=self.hparams.weight_decay)

    # ----------------------------------------------------------------- checkpoints
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["model_config"] = self.config.to_dict()
        # a resume inside the epoch keeps the epoch's running mean
        checkpoint["epoch_loss"] = {"epoch": self.current_epoch, "sum_count": self.epoch_loss.detach().cpu()}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Refuse a checkpoint of another model shape or other data, naming every differing field at once
        (before anything is loaded)."""
        problems = config_mismatches(shape_config(checkpoint.get("state_dict", {})), shape_config(self.state_dict()))
        datamodule = self.trainer.datamodule
        data_state = checkpoint.get(type(datamodule).__qualname__) if datamodule is not None else None
        if data_state and hasattr(datamodule, "checkpoint_mismatches"):
            problems += datamodule.checkpoint_mismatches(data_state)
        if problems:
            raise CheckpointError("checkpoint does not match this run (a resume needs the same model and data):\n  "
                                  + "\n  ".join(problems))
        self._restored_epoch_loss = checkpoint.get("epoch_loss")
