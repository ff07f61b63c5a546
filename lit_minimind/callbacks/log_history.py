"""The logged history that survives SIGKILLs: metric rows carried by checkpoints and logged again on
resume, CSV logs continued in the checkpoint's log directory, and a wandb run continued by its saved id
(on one step axis, ``micro_step``).

Loggers write asynchronously (wandb) or at intervals (CSV); a SIGKILL loses what they held. So the
rows logged since the save before the previous one (and those of the last minute, at most
``HISTORY_MAX_ROWS``) ride in the console callback's checkpointed state, and a resume logs them again,
with their values, to every logger whose files may lack them (not to a CSV logger continued by
:meth:`LogHistory.continue_logs`, whose file holds them).
"""

from __future__ import annotations

import csv
import io
import os
import time
from collections import deque
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only

from lit_minimind.callbacks.log_lineage import checkpoint_position, cut_ledger, went_further
from lit_minimind.checkpoint.atomic import atomic_open
from lit_minimind.checkpoint.names import CONSOLE_STATE_KEY
from lit_minimind.resume.internals import csv_logger_args
from lit_minimind.resume.io import callback_state

HISTORY_MAX_ROWS = 4096  # rows a checkpoint carries at most (the newest)
HISTORY_MIN_SECONDS = 60.0  # rows logged this recently before a save are always carried
EPOCH_METRICS = ("mean_loss", "val_loss", "val_perplexity")  # logged by Lightning once per epoch


class LogHistory:
    """The rows a checkpoint carries, which of them a resume logs again, and the CSV logs it continues."""

    def __init__(self) -> None:
        self.rows: deque[tuple[float, int, dict[str, Any]]] = deque(maxlen=HISTORY_MAX_ROWS)
        self.epochs_complete = 0  # epochs whose every batch is trained (for rows logged per epoch)
        self._saves: list[int] = []  # micro_step of the last three saves
        self._csv_logs: list[dict[str, Any]] = []  # the CSV loggers' directories (continued on resume)
        self._replay: list[tuple[int, dict[str, Any]]] = []
        self._complete_loggers: set[int] = set()  # CSV loggers whose file already holds the restored rows
        self._epoch_recorded = -1  # the last epoch whose end-of-epoch row is recorded (by this process)

    def record(self, step: int, metrics: dict[str, Any]) -> None:
        """A row just sent to the loggers."""
        self.rows.append((time.monotonic(), step, metrics))

    def epoch_row(self, trainer: L.Trainer, epoch: int, micro_step: int) -> tuple[int, dict[str, Any]] | None:
        """The row Lightning logs itself at the end of ``epoch`` (``mean_loss``, ``val_loss``, ...), if not
        recorded yet: taken when the epoch-end checkpoint is written, before Lightning sends it to the loggers."""
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k in EPOCH_METRICS}
        if not metrics or epoch <= self._epoch_recorded:
            return None
        return trainer.global_step, {**metrics, "epoch": float(epoch), "micro_step": micro_step}

    def record_epoch_metrics(self, trainer: L.Trainer, epoch: int, micro_step: int) -> None:
        """Carry the epoch's own row (:meth:`epoch_row`), once."""
        if row := self.epoch_row(trainer, epoch, micro_step):
            self._epoch_recorded = epoch
            self.record(*row)

    # ------------------------------------------------------------------ state
    def _after_save(self, micro_step: int, new: list[tuple[float, int, dict[str, Any]]]
                    ) -> tuple[list[int], list[tuple[float, int, dict[str, Any]]]]:
        """The saves and rows kept once a checkpoint at ``micro_step`` is taken (with ``new`` rows recorded):
        rows up to the save before the previous one are dropped, unless logged in the last
        :func:`history_seconds`."""
        saves = self._saves if self._saves and self._saves[-1] == micro_step else [*self._saves, micro_step][-3:]
        oldest_kept, recent = saves[0] if len(saves) == 3 else 0, time.monotonic() - history_seconds()
        rows = [*self.rows, *new][-HISTORY_MAX_ROWS:]
        first = next((i for i, (when, _, metrics) in enumerate(rows)
                      if metrics.get("micro_step", 0) > oldest_kept or when >= recent), len(rows))
        return saves, rows[first:]

    def state_dict(self, micro_step: int, new: list[tuple[int, dict[str, Any]]] = ()) -> dict[str, Any]:
        """What a checkpoint at ``micro_step`` carries once the ``new`` rows (``(step, metrics)``, not logged yet)
        are: changes nothing (:meth:`saved` does, when the checkpoint is taken)."""
        now = time.monotonic()
        saves, rows = self._after_save(micro_step, [(now, step, metrics) for step, metrics in new])
        return {"epochs_complete": self.epochs_complete, "saves": saves,
                "csv_logs": [dict(d) for d in self._csv_logs],
                "history": [{"step": step, "metrics": dict(metrics)} for _, step, metrics in rows]}

    def saved(self, micro_step: int) -> None:
        """A checkpoint at ``micro_step`` is taken: remember the save, drop the rows no longer needed."""
        self._saves, rows = self._after_save(micro_step, [])
        self.rows = deque(rows, maxlen=HISTORY_MAX_ROWS)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.epochs_complete = int(state_dict.get("epochs_complete") or 0)
        self._saves = list(state_dict.get("saves") or [])
        self._replay = [(int(row["step"]), dict(row["metrics"])) for row in state_dict.get("history") or []]

    # ------------------------------------------------------------------ resume
    def remember_csv_logs(self, trainer: L.Trainer) -> None:
        """At setup (the loggers' experiments exist): the CSV log directories a resume continues."""
        from lightning.fabric.loggers import CSVLogger

        self._csv_logs = [{"root_dir": str(lg.root_dir), "version": lg.version}
                          for lg in trainer.loggers if isinstance(lg, CSVLogger)]

    def continue_logs(self, trainer: L.Trainer, ckpt: dict[str, Any]) -> None:
        """Before ``trainer.fit(ckpt_path=...)``, while the loggers have not started: every CSV logger
        without a version of your choice continues the log directory of the checkpoint's run, its
        ``metrics.csv`` cut back to the rows logged up to the checkpoint (the rest is trained again).
        A continued logger is built again with the checkpoint's ``version`` (its public argument) and
        replaces the one that was never started in ``trainer.loggers``.

        Only when the checkpoint is that directory's newest save (:mod:`lit_minimind.callbacks.log_lineage`):
        a directory whose lineage saved again after the checkpoint is another lineage's and is left as it
        is; the logger starts a new version instead, with that directory's rows up to the checkpoint."""
        from lightning.fabric.loggers import CSVLogger

        state, global_step = callback_state(ckpt, CONSOLE_STATE_KEY), ckpt.get("global_step")
        epochs_complete = int(state.get("epochs_complete") or 0)
        if 0 < trainer.max_steps <= (global_step or 0):  # nothing left to train: the row the run ended with stays
            epochs_complete = max(epochs_complete, int(ckpt.get("epoch") or 0) + 1)
        loggers = list(trainer.loggers)
        positions = [i for i, lg in enumerate(loggers) if isinstance(lg, CSVLogger)]
        for i, saved in zip(positions, state.get("csv_logs") or []):
            args = csv_logger_args(loggers[i])
            if args["version"] is not None:
                continue  # a version you chose: Lightning's behaviour
            if os.path.normpath(str(loggers[i].root_dir)) != os.path.normpath(str(saved.get("root_dir"))):
                continue  # logs go elsewhere now: a new version there
            logger = type(loggers[i])(**{**args, "version": saved["version"]})
            position = checkpoint_position(ckpt)
            later = went_further(logger.log_dir, position) if rank_zero_only.rank == 0 else None
            if later is not None:  # another lineage's rows: a new version, branched from that one
                kept = branch_metrics_csv(loggers[i], Path(logger.log_dir), int(state.get("micro_step") or 0),
                                          epochs_complete, global_step)
                self._complete_loggers.add(id(loggers[i]))
                rank_zero_info(f"logs: {loggers[i].log_dir}, branched from {Path(logger.log_dir).name} at micro_step "
                               f"{state.get('micro_step')} ({kept} rows copied; {Path(logger.log_dir).name} went on to "
                               f"{later['checkpoint']}: its rows are another lineage's and stay as they are)")
                continue
            loggers[i] = logger
            if rank_zero_only.rank != 0:
                continue
            kept, dropped = continue_metrics_csv(logger, int(state.get("micro_step") or 0), epochs_complete, global_step)
            cut_ledger(logger.log_dir, position)
            self._complete_loggers.add(id(logger))
            rank_zero_info(f"logs: continuing {logger.log_dir} (metrics.csv: {kept} rows up to micro_step "
                           f"{state.get('micro_step')}" + (f"; {dropped} later rows dropped, trained again)" if dropped else ")"))
        trainer.loggers = loggers

    def replay(self, trainer: L.Trainer) -> None:
        """The restored rows, logged again (identical values) to every logger that may have lost them."""
        rows, self._replay = self._replay, []
        if not rows or not trainer.is_global_zero:
            return
        loggers = [lg for lg in trainer.loggers if id(lg) not in self._complete_loggers]
        for step, metrics in rows:
            for logger in loggers:
                logger.log_metrics(dict(metrics), step=step)
            self.record(step, metrics)  # logged now: carried by the next checkpoints again


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
        with atomic_open(path, "w") as f:
            out = csv.DictWriter(f, fieldnames=header)
            out.writeheader()
            out.writerows(kept)
        writer.metrics_keys = list(header)  # appends continue under this header (new keys: Lightning rewrites it)
    aside.unlink(missing_ok=True)
    return len(kept), len(rows) - len(kept)


def branch_metrics_csv(logger: Any, source: Path, micro_step: int, epochs_complete: int, global_step: int | None) -> int:
    """Start ``logger``'s writer in its new log directory with the rows of ``source``'s ``metrics.csv`` up to
    the checkpoint (as :func:`continue_metrics_csv` keeps them); ``source`` is only read. Returns the rows copied."""
    path, aside = source / "metrics.csv", source / "metrics.csv.resume"
    header, rows = _complete_rows(path if path.exists() else aside) if path.exists() or aside.exists() else ([], [])
    kept = [row for row in rows if _up_to(row, micro_step, epochs_complete, global_step)]
    writer = logger.experiment  # Lightning's writer, in a new (empty) directory
    if header:
        with atomic_open(Path(logger.log_dir) / "metrics.csv", "w") as f:
            out = csv.DictWriter(f, fieldnames=header)
            out.writeheader()
            out.writerows(kept)
        writer.metrics_keys = list(header)
    return len(kept)


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
