"""MiniMind's causal LM as a LightningModule: MiniMind's loss, optimizer and LR rule."""

from __future__ import annotations

import math
import os
import random
from typing import Any

import lightning as L
import torch
from torchmetrics.aggregation import MeanMetric

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
        # the epoch's mean training loss and the validation loss, reduced across ranks at compute (no host
        # sync per batch: NaN checks off). The training mean is checkpointed (in the state dict): a resume
        # inside an epoch continues it. Checkpoints without it (MiniMind's, older ones) start it empty.
        self.train_loss_mean = MeanMetric(nan_strategy="disable")
        self.train_loss_mean.persistent(True)
        self.val_loss_mean = MeanMetric(nan_strategy="disable")
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
        self.train_loss_mean.update(loss.detach().float())
        # per-micro-batch metrics go to the loggers from callbacks.MiniMindConsole, batched at its
        # log interval (Lightning's self.log would turn them into numbers, a host sync, every batch)
        return loss

    def on_train_epoch_end(self) -> None:
        if self.train_loss_mean.weight > 0:  # batches of this epoch trained (same count on every rank)
            self.log("mean_loss", self.train_loss_mean.compute(), prog_bar=True)  # one sync per epoch
        self.train_loss_mean.reset()

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        input_ids, labels = batch
        self.val_loss_mean.update(self.model(input_ids, labels=labels).loss.float())

    def on_validation_epoch_end(self) -> None:
        if self.val_loss_mean.weight > 0:
            val_loss = self.val_loss_mean.compute()
            self.log("val_loss", val_loss, prog_bar=True)
            self.log("val_perplexity", torch.exp(val_loss.clamp(max=50.0)))
        self.val_loss_mean.reset()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.model.parameters(), lr=self.hparams.learning_rate, weight_decay=self.hparams.weight_decay)

    # ----------------------------------------------------------------- checkpoints
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["model_config"] = self.config.to_dict()

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
        state = checkpoint.get("state_dict")
        if state is not None:  # saved without the epoch's mean (MiniMind's files, older ones): it starts empty
            for key, value in self.train_loss_mean.state_dict(prefix="train_loss_mean.").items():
                state.setdefault(key, torch.zeros_like(value))
