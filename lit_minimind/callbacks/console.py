"""MiniMind's console line, printed every ``log_interval`` batches through the progress bar, the
micro-batch metrics sent to the loggers (one host transfer per log interval), and what the closing
summary reports. The rows' history that survives SIGKILLs is :mod:`lit_minimind.callbacks.log_history`'s."""

from __future__ import annotations

import math
import sys
import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from lit_minimind.callbacks.log_history import LogHistory, flush_loggers
from lit_minimind.callbacks.log_lineage import SaveLedger
from lit_minimind.checkpoint.names import CONSOLE_STATE_KEY
from lit_minimind.resume.internals import batches_done


def format_minimind_line(epoch: int, epochs: int, step: int, iters: int, loss: float, logits_loss: float,
                         aux_loss: float, lr: float, eta_min: float) -> str:
    """MiniMind's exact log format, so existing log parsers keep working."""
    return (
        f"Epoch:[{epoch + 1}/{epochs}]({step}/{iters}), loss: {loss:.4f}, logits_loss: {logits_loss:.4f}, "
        f"aux_loss: {aux_loss:.4f}, lr: {lr:.8f}, epoch_time: {eta_min:.1f}min"
    )


def format_dpo_line(epoch: int, epochs: int, step: int, iters: int, loss: float, dpo_loss: float,
                    aux_loss: float, lr: float, eta_min: float, name: str = "dpo_loss") -> str:
    """MiniMind's ``train_dpo.py`` log format (the reward model's: ``name`` ``reward_loss``)."""
    return (
        f"Epoch:[{epoch + 1}/{epochs}]({step}/{iters}), loss: {loss:.4f}, {name}: {dpo_loss:.4f}, "
        f"aux_loss: {aux_loss:.4f}, learning_rate: {lr:.8f}, epoch_time: {eta_min:.3f}min"
    )


def format_distill_line(epoch: int, epochs: int, step: int, iters: int, loss: float, ce: float, aux_loss: float,
                        distill: float, lr: float, eta_min: float) -> str:
    """MiniMind's ``train_distillation.py`` log format."""
    return (
        f"Epoch:[{epoch + 1}/{epochs}]({step}/{iters}), loss: {loss:.4f}, ce: {ce:.4f}, aux_loss: {aux_loss:.4f}, "
        f"distill: {distill:.4f}, learning_rate: {lr:.8f}, epoch_time: {eta_min:.3f}min"
    )


def format_grpo_line(epoch: int, epochs: int, step: int, iters: int, row: dict[str, float]) -> str:
    """MiniMind's ``train_grpo.py`` log format (no epoch time in it)."""
    return (
        f"Epoch:[{epoch + 1}/{epochs}]({step}/{iters}), Reward: {row['reward']:.4f}, KL_ref: {row['kl_ref']:.4f}, "
        f"Adv Std: {row['advantages_std']:.4f}, Adv Mean: {row['advantages_mean']:.4f}, "
        f"Actor Loss: {row['loss']:.4f}, Avg Response Len: {row['avg_response_len']:.2f}, "
        f"Learning Rate: {row['learning_rate']:.8f}"
    )


def format_agent_line(epoch: int, epochs: int, step: int, iters: int, row: dict[str, float]) -> str:
    """MiniMind's ``train_agent.py`` log format (no epoch time in it)."""
    return (
        f"Epoch:[{epoch + 1}/{epochs}]({step}/{iters}), Reward:{row['reward']:.4f}, KL:{row['kl_ref']:.4f}, "
        f"GrpStd:{row['group_reward_std']:.4f}, AdvStd:{row['advantages_std']:.4f}, Loss:{row['loss']:.4f}, "
        f"AvgLen:{row['avg_response_len']:.2f}, AdvMean:{row['advantages_mean']:.4f}, LR:{row['learning_rate']:.8f}"
    )


def format_ppo_line(epoch: int, epochs: int, step: int, iters: int, row: dict[str, float]) -> str:
    """MiniMind's ``train_ppo.py`` log format (no epoch time in it)."""
    return (
        f"Epoch:[{epoch + 1}/{epochs}]({step}/{iters}), Reward: {row['reward']:.4f}, KL_ref: {row['kl_ref']:.4f}, "
        f"Approx KL: {row['approx_kl']:.4f}, ClipFrac: {row['clipfrac']:.4f}, Critic Loss: {row['critic_loss']:.4f}, "
        f"Avg Response Len: {row['avg_response_len']:.2f}, Actor LR: {row['learning_rate']:.8f}, "
        f"Critic LR: {row['critic_lr']:.8f}"
    )


def batch_tokens(batch: Any, rollout: dict[str, Any] | None = None) -> int:
    """Target tokens in a batch, from shapes only (no host sync): ``labels`` of ``(input_ids, labels)``,
    every ``y_*`` of a DPO dict batch; agent RL (records, no ids): the step's packed trajectories (``rollout``)."""
    if isinstance(batch, dict) and "messages" in batch:
        return int(rollout["completion_ids"].numel()) if rollout else 0
    if isinstance(batch, dict) and "input_ids" in batch:  # RL prompts: the prompt tokens, padding included
        return int(batch["input_ids"].numel())
    if isinstance(batch, dict):
        return sum(int(v.numel()) for k, v in batch.items() if k.startswith("y_"))
    return int(batch[1].numel())


class MiniMindConsole(Callback):
    """MiniMind's logging: its console line and per-micro-batch metrics for the loggers.

    Prints MiniMind's line on global rank 0 every ``log_interval`` steps and at each epoch's last,
    and sends every micro-batch's ``loss``, ``logits_loss``, ``aux_loss``, ``learning_rate``,
    ``epoch_time``, ``tokens_per_s``, ``perplexity``, ``epoch`` and ``micro_step`` to the trainer's
    loggers (every tensor of the module's ``last_stats``: DPO logs ``dpo_loss`` and the rewards
    instead of ``logits_loss`` and ``perplexity``, and prints MiniMind's DPO line; distillation logs
    ``ce`` and ``distill`` and prints ``train_distillation.py``'s line). ``micro_step``
    counts the micro-batches trained so far (per process, 1-based): it is checkpointed, so it
    continues across resumes, also on another number of processes.

    Nothing logged is lost to a SIGKILL: the rows a resume may need ride in this callback's
    checkpointed state (:class:`lit_minimind.callbacks.log_history.LogHistory`). Loggers are flushed
    (``logger.save()``) before every checkpoint, so a CSV file is never behind a checkpoint. ``epoch_time`` is MiniMind's estimate of the minutes left in the
    epoch, measured from the epoch's (or the resume's) first batch. Also keeps what the end-of-run
    summary reports.

    Args:
        log_interval: print every this many batches of an epoch (MiniMind's ``log_interval``).
    """

    def __init__(self, log_interval: int = 100) -> None:
        if log_interval < 1:
            raise ValueError(f"log_interval must be >= 1, got {log_interval}")
        self.log_interval = log_interval
        self.first_loss: float | None = None
        self._last_loss: Any = None  # the last micro-batch's loss tensor: converted once, in last_loss
        self.batches = 0
        self.tokens = 0
        self.train_seconds = 0.0
        self._epoch_start: tuple[float, int] | None = None
        self._fit_start = 0.0
        self._last_batch_end = 0.0
        # checkpointed: the step axis and the rows that may not be durable in the loggers yet
        self.micro_step: int | None = None  # micro-batches trained so far; None: count from the position
        self.history = LogHistory()
        self.ledger = SaveLedger()  # the saves whose rows the CSV log directory holds (callbacks.log_lineage)
        self._pending: list[tuple[Any, ...]] = []  # rows since the last log interval, losses still on the device
        self._trainer: L.Trainer | None = None

    # ------------------------------------------------------------------ state (Lightning saves and restores it)
    @property
    def state_key(self) -> str:
        return CONSOLE_STATE_KEY

    def state_dict(self) -> dict[str, Any]:
        """What a resume needs, as the checkpoint being taken leaves it: the rows held for the log interval and
        the epoch's own row count as logged. Changes nothing: :meth:`on_save_checkpoint`, which Lightning calls
        next, logs them."""
        trainer, new = self._trainer, []
        if trainer is not None:
            new = self.pending_rows()
            if row := self._epoch_row(trainer):
                new.append(row)
        return {"micro_step": self.micro_step, **self.history.state_dict(self.micro_step or 0, new)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.micro_step = state_dict.get("micro_step")
        self.history.load_state_dict(state_dict)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        """A checkpoint is being taken (its state is dumped already): the rows held for the log interval go
        to the loggers, the epoch's own row is carried, and what the loggers hold goes to their files (CSV:
        ``metrics.csv``) before the checkpoint is written."""
        self.log_pending(trainer)
        if self._epoch_row(trainer):
            self.history.record_epoch_metrics(trainer, trainer.current_epoch, self.micro_step or 0)
        self.history.saved(self.micro_step or 0)
        flush_loggers(trainer)

    def _epoch_row(self, trainer: L.Trainer) -> tuple[int, dict[str, Any]] | None:
        """At the epoch-end save (global rank 0): the row Lightning logs itself for the epoch, not carried yet."""
        if not (trainer.is_global_zero and self.history.epochs_complete > trainer.current_epoch):
            return None
        return self.history.epoch_row(trainer, trainer.current_epoch, self.micro_step or 0)

    # ------------------------------------------------------------------ the checkpoint manager's events
    def on_checkpoint_chosen(self, trainer: L.Trainer, start: Any) -> None:
        """Before a resume from ``start`` (global rank 0's read): CSV logs continue its log directory
        (:meth:`LogHistory.continue_logs`)."""
        self.history.continue_logs(trainer, start.ckpt)

    def on_checkpoint_saved(self, trainer: L.Trainer, path: str) -> None:
        """A save's snapshot is taken: its line in the CSV log directory's ledger (callbacks.log_lineage)."""
        self.ledger.record(trainer, path)

    # ------------------------------------------------------------------ hooks
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._trainer = trainer
        self.history.remember_csv_logs(trainer)  # the loggers' experiments exist by now

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.history.replay(trainer)  # here: a resume with nothing left to train never starts training

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.history.replay(trainer)  # strategies that restore callbacks after on_fit_start
        self._fit_start = time.perf_counter()

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        flush_loggers(trainer)  # the previous epoch's rows logged after its checkpoint (mean_loss, val_loss)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        step, iters = batch_idx + 1, int(trainer.num_training_batches)
        if self.micro_step is None:  # a fresh run, or a checkpoint without our state: count from the position
            self.micro_step = trainer.current_epoch * iters + batch_idx
        self.micro_step += 1
        self.history.epochs_complete = trainer.current_epoch
        if self._epoch_start is None or self._epoch_start[1] > batch_idx:
            self._epoch_start = (time.perf_counter(), batch_idx)
        self.batches += 1
        tokens = batch_tokens(batch, getattr(pl_module, "rollout_log", None)) * trainer.world_size  # shapes: no sync
        self.tokens += tokens
        now = time.perf_counter()
        tokens_per_s = tokens / max(now - self._last_batch_end, 1e-9) if self._last_batch_end else 0.0
        self._last_batch_end = now
        stats = pl_module.last_stats
        self._last_loss = stats["loss"]
        start_time, start_idx = self._epoch_start
        spent = time.perf_counter() - start_time
        eta_min = spent / max(batch_idx + 1 - start_idx, 1) * (iters - step) // 60
        if trainer.is_global_zero:  # kept on the device; sent to the host at the log interval, all at once
            names = tuple(k for k, v in stats.items() if isinstance(v, torch.Tensor))
            losses = torch.stack([stats[k].detach().float() for k in names])
            self._pending.append((self.micro_step, trainer.global_step, trainer.current_epoch, losses, float(stats["lr"]),
                                  {"epoch_time": eta_min, "tokens_per_s": tokens_per_s}, names))
        if not (step % self.log_interval == 0 or step == iters):
            return
        rows = self.log_pending(trainer)
        if trainer.is_global_zero and rows:
            row = rows[-1]
            if "dpo_loss" in row or "reward_loss" in row:
                name = "dpo_loss" if "dpo_loss" in row else "reward_loss"
                line = format_dpo_line(trainer.current_epoch, trainer.max_epochs or 1, step, iters, row["loss"],
                                       row[name], row["aux_loss"], row["learning_rate"], eta_min, name)
            elif "clipfrac" in row:
                line = format_ppo_line(trainer.current_epoch, trainer.max_epochs or 1, step, iters, row)
            elif "group_reward_std" in row:
                line = format_agent_line(trainer.current_epoch, trainer.max_epochs or 1, step, iters, row)
            elif "kl_ref" in row:
                line = format_grpo_line(trainer.current_epoch, trainer.max_epochs or 1, step, iters, row)
            elif "distill" in row:
                line = format_distill_line(trainer.current_epoch, trainer.max_epochs or 1, step, iters, row["loss"],
                                           row["ce"], row["aux_loss"], row["distill"], row["learning_rate"], eta_min)
            else:
                line = format_minimind_line(trainer.current_epoch, trainer.max_epochs or 1, step, iters, row["loss"],
                                            row["loss"] - row["aux_loss"], row["aux_loss"], row["learning_rate"], eta_min)
            console_print(trainer, line)

    @property
    def last_loss(self) -> float | None:
        """The loss of the last trained micro-batch of this run (None before the first)."""
        return None if self._last_loss is None else float(self._last_loss)

    def pending_rows(self) -> list[tuple[int, dict[str, Any]]]:
        """The rows (``(global_step, metrics)``) of the micro-batches held since the last log interval, with one
        device-to-host transfer for all of them."""
        if not self._pending:
            return []
        values = torch.stack([p[3] for p in self._pending]).float().cpu().tolist()  # the one host sync
        rows = []
        for (micro_step, global_step, epoch, _, lr, extra, names), row in zip(self._pending, values):
            metrics = {**dict(zip(names, row)), "learning_rate": lr}
            if "logits_loss" in metrics:
                metrics["perplexity"] = math.exp(min(metrics["logits_loss"], 50.0))
            metrics.update({"epoch": float(epoch), **extra, "micro_step": micro_step})
            rows.append((global_step, metrics))
        return rows

    def log_pending(self, trainer: L.Trainer) -> list[dict[str, Any]]:
        """Send the rows held since the last log interval (:meth:`pending_rows`) to the loggers; returns them."""
        rows, self._pending = self.pending_rows(), []
        for global_step, metrics in rows:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=global_step)
            self.history.record(global_step, metrics)
        if rows and self.first_loss is None:
            self.first_loss = rows[0][1]["loss"]
        return [metrics for _, metrics in rows]

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Every validation's results in one line, for every stage that validates (``val_loss``, and
        ``val_perplexity`` or the reward model's ``val_reward_accuracy``)."""
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val_")}
        if trainer.sanity_checking or not metrics or not trainer.is_global_zero:
            return
        where = f"epoch {trainer.current_epoch + 1} step {batches_done(trainer)}/{int(trainer.num_training_batches)}"
        console_print(trainer, f"validation after {where}: " + ", ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items())))

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._epoch_start = None
        if batches_done(trainer) >= int(trainer.num_training_batches):
            self.history.epochs_complete = trainer.current_epoch + 1  # before the epoch-end checkpoint (callbacks last)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.log_pending(trainer)
        self.train_seconds = time.perf_counter() - self._fit_start

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """A fit that ended normally (ResumeCallback waited for its writes at train end): its saves are committed."""
        if stage == "fit":
            self.ledger.end(trainer)


def console_print(trainer: L.Trainer, line: str) -> None:
    """A line on its own line: through the progress bar's ``print`` while a bar is live (it clears the
    bar, prints, redraws), else ``print``."""
    bar = trainer.progress_bar_callback
    if bar is not None and bar.is_enabled:
        bar.print(line)
        sys.stdout.flush()
        return
    print(line, flush=True)
