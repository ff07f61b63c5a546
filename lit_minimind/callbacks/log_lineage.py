"""Whose rows a CSV log directory holds: a resume continues it only when the checkpoint is that
directory's newest save, else it branches to a new version.

A checkpoint names the log directory of its run (``version_N``), and a resume continues it, cutting
``metrics.csv`` back to the checkpoint (:meth:`lit_minimind.callbacks.log_history.LogHistory.continue_logs`).
Rows beyond the checkpoint mean one of two things:

* the run was killed (SIGKILL, a failed write) after the checkpoint: they are this lineage's, trained again
  from the checkpoint, and are dropped (the directory keeps every ``micro_step`` once, in order);
* the run went on past the checkpoint and saved again (a finished run, resumed from an older checkpoint
  or from a copy of its checkpoint directory): they are another lineage's history, never rewritten.

The rule that tells them apart is kept in the directory itself, in ``saves.jsonl``: global rank 0 appends
one line per ResumeCallback save once ``trainer.save_checkpoint`` returned (the name of the ``.ckpt`` and
its directory; with ``async_save`` its bytes may still be in flight) and an ``end`` line when a fit ended
normally (every write committed). At most one save is in flight, and the next save (or the end) starts only
once it is committed, so **every line but the file's last stands for a committed save**. A resume from
checkpoint C continues the directory iff no committed save beyond C is listed: no line beyond C, or only
the last line, whose ``.ckpt`` was never committed (not on disk: the save a kill interrupted). Otherwise
the run starts a new version, copying the rows up to C, and says which version it branched from.
A directory without ``saves.jsonl`` (written before it existed) is continued as before.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lit_minimind.checkpoint.atomic import atomic_open
from lit_minimind.checkpoint.names import RESUME_STATE_KEY, CheckpointName

LEDGER = "saves.jsonl"


def read_ledger(log_dir: str | Path) -> list[dict[str, Any]] | None:
    """The directory's entries in order (a line torn by a kill is left out); None without a ledger."""
    path = Path(log_dir) / LEDGER
    try:
        text = path.read_text()
    except OSError:
        return None
    entries = []
    for line in text.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict):
            entries.append(entry)
    return entries


def append(log_dir: str | Path, entry: dict[str, Any]) -> None:
    """One line (no fsync: what a SIGKILL must not lose is in the page cache once written)."""
    with open(Path(log_dir) / LEDGER, "a", encoding="utf-8") as f:
        f.write(json.dumps(entry) + "\n")


def save_entry(checkpoint: str | Path) -> dict[str, Any] | None:
    """The line of a ResumeCallback save (None for another file: a ModelCheckpoint of yours)."""
    path = Path(checkpoint)
    name = CheckpointName.parse(path.name)
    if name is None:
        return None
    return {"checkpoint": path.name, "dir": str(path.absolute().parent), "epoch": name.epoch, "step": name.step,
            "global_step": name.global_step, "run_id": name.run_id}


def checkpoint_position(ckpt: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's save, as its ledger line names it."""
    state = (ckpt.get("callbacks") or {}).get(RESUME_STATE_KEY) or {}
    return {"epoch": ckpt.get("epoch"), "step": ckpt.get("step"), "global_step": ckpt.get("global_step"),
            "run_id": state.get("run_id")}


def _order(entry: dict[str, Any]) -> tuple[int, int, int]:
    return int(entry.get("global_step") or 0), int(entry.get("epoch") or 0), int(entry.get("step") or 0)


def _beyond(entry: dict[str, Any], position: dict[str, Any]) -> bool:
    return ("checkpoint" in entry and entry.get("run_id") == position.get("run_id")
            and None not in (position.get("global_step"), position.get("epoch"), position.get("step"))
            and _order(entry) > _order(position))


def went_further(log_dir: str | Path, position: dict[str, Any]) -> dict[str, Any] | None:
    """The newest committed save beyond ``position`` the directory lists (its lineage went on: branch), or None
    (continue it: nothing beyond, only a save a kill interrupted, or no ledger)."""
    entries = read_ledger(log_dir)
    if not entries:
        return None
    committed = [entry for i, entry in enumerate(entries) if _beyond(entry, position)
                 and (i < len(entries) - 1 or (Path(str(entry.get("dir"))) / str(entry["checkpoint"])).exists())]
    return max(committed, key=_order) if committed else None


def cut_ledger(log_dir: str | Path, position: dict[str, Any]) -> None:
    """A continued directory: the save lines beyond the checkpoint (the interrupted save) go, as its rows do."""
    entries = read_ledger(log_dir)
    if entries is None:
        return
    kept = [entry for entry in entries if not _beyond(entry, position)]
    if len(kept) != len(entries):
        with atomic_open(Path(log_dir) / LEDGER, "w") as f:
            f.writelines(json.dumps(entry) + "\n" for entry in kept)


class SaveLedger:
    """Global rank 0's side: the lines of this run's saves, in every CSV logger's directory."""

    def __init__(self) -> None:
        self._recorded: str | None = None  # the newest save written down

    def record(self, trainer: Any, path: str) -> None:
        """A ResumeCallback save, once its snapshot is taken (the manager's ``saved`` event)."""
        entry = save_entry(path)
        if not trainer.is_global_zero or entry is None or path == self._recorded:
            return
        self._recorded = path
        for log_dir in csv_log_dirs(trainer):
            append(log_dir, entry)

    def end(self, trainer: Any) -> None:
        """The fit ended normally: every save is committed (ResumeCallback waited for them at train end)."""
        if not trainer.is_global_zero or getattr(trainer.strategy.checkpoint_io, "failed", False):
            return
        for log_dir in csv_log_dirs(trainer):
            append(log_dir, {"end": True, "global_step": int(trainer.global_step)})


def csv_log_dirs(trainer: Any) -> list[Path]:
    from lightning.fabric.loggers import CSVLogger

    found = []
    for logger in trainer.loggers:
        if isinstance(logger, CSVLogger):
            log_dir = Path(logger.log_dir)
            if log_dir.is_dir():
                found.append(log_dir)
    return found
