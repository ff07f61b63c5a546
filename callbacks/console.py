"""MiniMind's console line, printed every ``log_interval`` batches, a closing summary, and a logged
history that survives SIGKILLs (rows carried by the checkpoint, CSV logs continued on resume)."""

from __future__ import annotations

import csv
import io
import math
import os
import time
from collections import deque
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only

HISTORY_MAX_ROWS = 4096  # rows a checkpoint carries at most (the newest)
HISTORY_MIN_SECONDS = 60.0  # rows logged this recently before a save are always carried


def format_minimind_line(epoch: int, epochs: int, step: int, iters: int, loss: float, logits_loss: float,
                         aux_loss: float, lr: float, eta_min: float) -> str:
    """MiniMind's exact log format, so existing log parsers keep working."""
    return (
        f"Epoch:[{epoch + 1}/{epochs}]({step}/{iters}), loss: {loss:.4f}, logits_loss: {logits_loss:.4f}, "
        f"aux_loss: {aux_loss:.4f}, lr: {lr:.8f}, epoch_time: {eta_min:.1f}min"
    )


class MiniMindConsole(Callback):
    """MiniMind's logging: its console line and per-micro-batch metrics for the loggers.

    Prints MiniMind's line on global rank 0 every ``log_interval`` steps and at each epoch's last,
    and sends every micro-batch's ``loss``, ``logits_loss``, ``aux_loss``, ``learning_rate``,
    ``epoch_time``, ``tokens_per_s``, ``perplexity``, ``epoch`` and ``micro_step`` to the trainer's
    loggers. ``micro_step`` counts the micro-batches trained so far (per process, 1-based): it is
    checkpointed, so it continues across resumes, also on another number of processes.

    Nothing logged is lost to a SIGKILL: the metric rows that may not have reached a logger's files
    yet (those logged since the save before the previous one, and those of the last minute, at most
    ``HISTORY_MAX_ROWS``) are part of this callback's checkpointed state and are logged again, with
    their values, when a run resumes (not to a CSV logger continued by :meth:`continue_logs`, whose
    file holds them). Loggers are flushed (``logger.save()``) before every checkpoint, so a CSV file
    is never behind a checkpoint. ``epoch_time`` is MiniMind's estimate of the minutes left in the
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
        self._history: deque[tuple[float, int, dict[str, Any]]] = deque(maxlen=HISTORY_MAX_ROWS)
        self._epochs_complete = 0  # epochs whose every batch is trained (for rows logged per epoch)
        self._saves: list[int] = []  # micro_step of the last three saves
        self._csv_logs: list[dict[str, Any]] = []  # the CSV loggers' directories (continued on resume)
        self._replay: list[tuple[int, dict[str, Any]]] = []
        self._pending: list[tuple[Any, ...]] = []  # rows since the last log interval, losses still on the device
        self._trainer: L.Trainer | None = None  # restored rows, logged again at fit start
        self._complete_loggers: set[int] = set()  # CSV loggers whose file already holds the restored rows

    # ------------------------------------------------------------------ state (Lightning saves and restores it)
    def state_dict(self) -> dict[str, Any]:
        """Called for every checkpoint: drops the rows no longer needed, returns what a resume needs."""
        if self._trainer is not None:
            self.log_pending(self._trainer)  # rows held for the log interval go out before the checkpoint
        micro_step = self.micro_step or 0
        if not self._saves or self._saves[-1] != micro_step:
            self._saves = [*self._saves, micro_step][-3:]  # this save, the previous one and the one before
        # dropped: rows up to the save before the previous one, logged long enough ago
        oldest_kept, recent = self._saves[0] if len(self._saves) == 3 else 0, time.monotonic() - history_seconds()
        while self._history and self._history[0][2].get("micro_step", 0) <= oldest_kept and self._history[0][0] < recent:
            self._history.popleft()
        return {"micro_step": self.micro_step, "epochs_complete": self._epochs_complete, "saves": list(self._saves),
                "csv_logs": [dict(d) for d in self._csv_logs],
                "history": [{"step": step, "metrics": dict(metrics)} for _, step, metrics in self._history]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.micro_step = state_dict.get("micro_step")
        self._epochs_complete = int(state_dict.get("epochs_complete") or 0)
        self._saves = list(state_dict.get("saves") or [])
        self._replay = [(int(row["step"]), dict(row["metrics"])) for row in state_dict.get("history") or []]

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        """Before the checkpoint is written: what the loggers hold goes to their files (CSV: ``metrics.csv``)."""
        flush_loggers(trainer)

    # ------------------------------------------------------------------ resume
    def continue_logs(self, trainer: L.Trainer, ckpt_path: str | os.PathLike) -> None:
        """Before ``trainer.fit(ckpt_path=...)``, while the loggers have not started: every CSV logger
        without a version of your choice continues the log directory of the checkpoint's run, its
        ``metrics.csv`` cut back to the rows logged up to the checkpoint (the rest is trained again)."""
        from lightning.fabric.loggers import CSVLogger

        state, global_step = peek_console_state(ckpt_path)
        csv_loggers = [lg for lg in trainer.loggers if isinstance(lg, CSVLogger)]
        for logger, saved in zip(csv_loggers, state.get("csv_logs") or []):
            if getattr(logger, "_experiment", None) is not None or getattr(logger, "_version", None) is not None:
                continue  # started already, or a version you chose: Lightning's behaviour
            if os.path.normpath(str(logger.root_dir)) != os.path.normpath(str(saved.get("root_dir"))):
                continue  # logs go elsewhere now: a new version there
            logger._version = saved["version"]  # CSVLogger has no public setter; its constructor argument
            if rank_zero_only.rank != 0:
                continue
            kept, dropped = continue_metrics_csv(logger, int(state.get("micro_step") or 0),
                                                 int(state.get("epochs_complete") or 0), global_step)
            self._complete_loggers.add(id(logger))
            rank_zero_info(f"logs: continuing {logger.log_dir} (metrics.csv: {kept} rows up to micro_step "
                           f"{state.get('micro_step')}" + (f"; {dropped} later rows dropped, trained again)" if dropped else ")"))

    def _log_restored_rows(self, trainer: L.Trainer) -> None:
        """The restored rows, logged again (identical values) to every logger that may have lost them."""
        rows, self._replay = self._replay, []
        if not rows or not trainer.is_global_zero:
            return
        loggers = [lg for lg in trainer.loggers if id(lg) not in self._complete_loggers]
        now = time.monotonic()
        for step, metrics in rows:
            for logger in loggers:
                logger.log_metrics(dict(metrics), step=step)
            self._history.append((now, step, metrics))  # logged now: carried by the next checkpoints again

    # ------------------------------------------------------------------ hooks
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        from lightning.fabric.loggers import CSVLogger

        self._trainer = trainer
        # the loggers' experiments exist by now (Lightning creates them before callbacks' setup)
        self._csv_logs = [{"root_dir": str(lg.root_dir), "version": lg.version}
                          for lg in trainer.loggers if isinstance(lg, CSVLogger)]

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._log_restored_rows(trainer)  # here: a resume with nothing left to train never starts training

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._log_restored_rows(trainer)  # strategies that restore callbacks after on_fit_start
        self._fit_start = time.perf_counter()

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        flush_loggers(trainer)  # the previous epoch's rows logged after its checkpoint (mean_loss, val_loss)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        step, iters = batch_idx + 1, int(trainer.num_training_batches)
        if self.micro_step is None:  # a fresh run, or a checkpoint without our state: count from the position
            self.micro_step = trainer.current_epoch * iters + batch_idx
        self.micro_step += 1
        self._epochs_complete = trainer.current_epoch
        if self._epoch_start is None or self._epoch_start[1] > batch_idx:
            self._epoch_start = (time.perf_counter(), batch_idx)
        self.batches += 1
        tokens = int(batch[1].numel()) * trainer.world_size  # shape metadata: no host sync
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
            losses = torch.stack([stats["loss"], stats["logits_loss"], stats["aux_loss"]]).detach()
            self._pending.append((self.micro_step, trainer.global_step, trainer.current_epoch, losses, float(stats["lr"]),
                                  {"epoch_time": eta_min, "tokens_per_s": tokens_per_s}))
        if not (step % self.log_interval == 0 or step == iters):
            return
        rows = self.log_pending(trainer)
        if trainer.is_global_zero and rows:
            row = rows[-1]
            print(format_minimind_line(trainer.current_epoch, trainer.max_epochs or 1, step, iters, row["loss"],
                                       row["loss"] - row["aux_loss"], row["aux_loss"], row["learning_rate"], eta_min),
                  flush=True)

    @property
    def last_loss(self) -> float | None:
        """The loss of the last trained micro-batch of this run (None before the first)."""
        return None if self._last_loss is None else float(self._last_loss)

    def log_pending(self, trainer: L.Trainer) -> list[dict[str, Any]]:
        """Send the micro-batches' metrics held since the last log interval to the loggers, with one
        device-to-host transfer for all of them; returns their rows."""
        pending, self._pending = self._pending, []
        if not pending:
            return []
        values = torch.stack([p[3] for p in pending]).float().cpu().tolist()  # the one host sync
        rows = []
        for (micro_step, global_step, epoch, _, lr, extra), (loss, logits_loss, aux_loss) in zip(pending, values):
            metrics = {"loss": loss, "logits_loss": logits_loss, "aux_loss": aux_loss, "learning_rate": lr,
                       "perplexity": math.exp(min(logits_loss, 50.0)), "epoch": float(epoch), **extra,
                       "micro_step": micro_step}
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=global_step)
            self._history.append((time.monotonic(), global_step, metrics))
            rows.append(metrics)
        if self.first_loss is None:
            self.first_loss = rows[0]["loss"]
        return rows

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._epoch_start = None
        if int(trainer.fit_loop.epoch_loop.batch_progress.current.processed) >= int(trainer.num_training_batches):
            self._epochs_complete = trainer.current_epoch + 1  # before the epoch-end checkpoint (callbacks last)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.log_pending(trainer)
        self.train_seconds = time.perf_counter() - self._fit_start


def history_seconds() -> float:
    """How recent a row must be to ride with a checkpoint regardless of saves: a minute, or four of
    wandb's run-file flush intervals if longer."""
    try:
        flush = float(os.environ.get("WANDB__TRANSACTION_LOG_FLUSH_INTERVAL", 15))
    except ValueError:
        flush = 15.0
    return max(HISTORY_MIN_SECONDS, 4 * flush)


def flush_loggers(trainer: L.Trainer) -> None:
    """``logger.save()`` of every logger (CSV: appends the rows held in memory to ``metrics.csv``)."""
    for logger in trainer.loggers:
        logger.save()


def peek_console_state(path: str | os.PathLike) -> tuple[dict[str, Any], int | None]:
    """This callback's state in a checkpoint, and the checkpoint's global step; memory-mapped (only
    the small entries are read). ``({}, None)`` for a file without it (e.g. original MiniMind's)."""
    import torch

    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:
        return {}, None  # the resume itself reports what is wrong with the file
    if not isinstance(ckpt, dict):
        return {}, None
    state = (ckpt.get("callbacks") or {}).get(MiniMindConsole.__qualname__) or {}
    return dict(state), ckpt.get("global_step")


def continue_metrics_csv(logger: Any, micro_step: int, epochs_complete: int, global_step: int | None) -> tuple[int, int]:
    """Start ``logger``'s writer in its (existing) log directory keeping ``metrics.csv``'s rows up to
    the checkpoint: ``micro_step`` <= the checkpoint's, rows logged per epoch (``mean_loss``,
    ``val_loss``) of the epochs it completed. Lightning's writer deletes an existing ``metrics.csv``; the file is moved
    aside first (``metrics.csv.resume``, read instead if a kill left only it), so a kill at any
    moment keeps every row. Returns (rows kept, rows dropped)."""
    log_dir = Path(logger.log_dir)
    path, aside = log_dir / "metrics.csv", log_dir / "metrics.csv.resume"
    if path.exists():
        os.replace(path, aside)
    header, rows = _complete_rows(aside) if aside.exists() else ([], [])
    kept = [row for row in rows if _up_to(row, micro_step, epochs_complete, global_step)]
    import warnings

    with warnings.catch_warnings():  # "exists and is not empty ... will be deleted": not so, it continues
        warnings.filterwarnings("ignore", message=r".*Experiment logs directory .* exists and is not empty.*")
        writer = logger.experiment  # Lightning's writer, started in the existing directory
    if header:
        tmp = log_dir / "metrics.csv.tmp"
        with open(tmp, "w", newline="") as f:
            out = csv.DictWriter(f, fieldnames=header)
            out.writeheader()
            out.writerows(kept)
        os.replace(tmp, path)
        writer.metrics_keys = list(header)  # appends continue under this header (new keys: Lightning rewrites it)
    aside.unlink(missing_ok=True)
    return len(kept), len(rows) - len(kept)


def _complete_rows(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    """Header and rows of a CSV file, without a last line torn by a kill."""
    with open(path, newline="") as f:
        text = f.read()
    text = text[: text.rfind("\n") + 1]
    reader = csv.DictReader(io.StringIO(text, newline=""))
    rows = list(reader)
    return list(reader.fieldnames or []), [row for row in rows if None not in row and None not in row.values()]


def _up_to(row: dict[str, str], micro_step: int, epochs_complete: int, global_step: int | None) -> bool:
    """Whether a ``metrics.csv`` row was logged before the checkpoint (and is not logged again after it)."""
    try:
        if row.get("micro_step"):
            return int(float(row["micro_step"])) <= micro_step
        if row.get("epoch"):  # Lightning adds the epoch to what it logs
            return int(float(row["epoch"])) < epochs_complete
        return global_step is not None and int(float(row.get("step") or 0)) < global_step
    except ValueError:
        return False
