"""A run's checkpoint files: their names, which of them stay, and which one ``last`` means.

Several runs may share one checkpoint directory. Each save's ``.ckpt`` carries its run's id (in its name and
manifest, kept across resumes). ``keep_last`` is per run: each run keeps its own newest ``keep_last`` and never
prunes another run's files, so a directory holding many runs grows with every fresh run; ``keep_runs N`` bounds
it: at a run's first save the checkpoints of all but the newest ``N`` runs (this one included, never removed) are
deleted (:func:`prune_runs`). ``_resume.pth`` may be ours, another Lightning run's or original MiniMind's
(:func:`resume_link`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lit_minimind.checkpoint.atomic import atomic_link, atomic_save, read_manifest, remove_file
from lit_minimind.checkpoint.names import RESUME_STATE_KEY, CheckpointName, expired, minimind_file_names
from lit_minimind.checkpoint.read import verify_checkpoint, verify_manifest
from lit_minimind.errors import CheckpointError


class CheckpointFiles:
    """MiniMind's two names for a ``stem`` (``{weight}_{hidden}{_moe}``) plus our rolling window.

    * ``{ckpt_dir}/{stem}_e{epoch}_s{step}_g{global_step}_{run_id}.ckpt``: one per save (the
      Lightning checkpoint, also MiniMind's resume dict); the newest ``keep_last`` of this run stay;
      ``run_id`` keeps runs apart, so a fresh run never replaces or prunes another run's files, unless
      ``keep_runs`` is set: then only the newest ``keep_runs`` runs' files stay (:func:`prune_runs`).
    * ``{ckpt_dir}/{stem}_resume.pth``: a hard link to the newest of them (MiniMind's name).
    * ``{out_dir}/{stem}.pth``: MiniMind's fp16 weight export, written after the checkpoint.
    """

    def __init__(self, ckpt_dir: str | Path, out_dir: str | Path, weight: str, keep_last: int,
                 keep_runs: int | None = None) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        if keep_runs is not None and keep_runs < 1:
            raise ValueError(f"keep_runs must be >= 1 (or unset: every run's files stay), got {keep_runs}")
        self.ckpt_dir, self.out_dir, self.weight, self.keep_last = Path(ckpt_dir), Path(out_dir), weight, keep_last
        self.keep_runs, self._runs_pruned = keep_runs, False

    def checkpoint(self, name: CheckpointName) -> Path:
        return self.ckpt_dir / str(name)

    def best(self, stem: str) -> Path:
        return self.ckpt_dir / f"{stem}_best.ckpt"

    def export(self, stem: str) -> Path:
        return self.out_dir / minimind_file_names(stem)[0]

    def resume(self, stem: str) -> Path:
        return self.ckpt_dir / minimind_file_names(stem)[1]

    def publish(self, checkpoint: Path, stem: str, weights: dict[str, torch.Tensor]) -> list[Path]:
        """After ``checkpoint`` is committed: MiniMind's ``_resume.pth`` (a link) and fp16 export."""
        meta = {k: v for k, v in read_manifest(checkpoint).items() if k in ("epoch", "step", "global_step", "run_id")}
        atomic_link(checkpoint, self.resume(stem))
        atomic_save(weights, self.export(stem), {"kind": "weights", **meta})
        return [self.export(stem), self.resume(stem)]

    def published(self, checkpoint: Path, stem: str) -> bool:
        """MiniMind's two files hold this checkpoint's save (not one a kill left behind)."""
        keys = ("epoch", "step", "global_step", "run_id")
        saved = read_manifest(checkpoint)
        for path in (self.export(stem), self.resume(stem)):
            if not path.exists() or any(saved.get(k) != read_manifest(path).get(k) for k in keys):
                return False
            if os.path.samefile(path, checkpoint):
                continue  # the link to the checkpoint itself, whose bytes were verified (not read again)
            try:
                verify_manifest(path, accept_replaced=False)
            except CheckpointError:
                return False
        return True

    def prune(self, stem: str, run_id: str) -> None:
        """Keep the newest ``keep_last`` checkpoints of this run (never another run's files); with
        ``keep_runs``, at this process's first save, only the newest ``keep_runs`` runs' checkpoints."""
        saves = ((p, run_of(p), save_order_key(p)) for p in CheckpointName.find(self.ckpt_dir, stem))
        for old in expired(saves, run_id, self.keep_last):
            remove_file(old)
        if self.keep_runs is not None and not self._runs_pruned:
            self._runs_pruned = True
            prune_runs(self.ckpt_dir, stem, run_id, self.keep_runs)


def save_order_key(path: Path) -> tuple[int, bool]:
    """When a checkpoint was saved (manifest time, else file mtime); on a tie the Lightning one first."""
    saved_at = read_manifest(path).get("saved_at")
    if saved_at is None:
        saved_at = path.stat().st_mtime_ns if path.exists() else 0
    return int(saved_at), path.suffix == ".ckpt"


def resolve_last(ckpt_dir: str | Path, stem: str, verify: bool = True) -> Path | None:
    """The most recently saved valid resume checkpoint of ``stem`` in ``ckpt_dir``; ``None`` when there
    is none at all.

    Candidates: our checkpoints and MiniMind's ``{stem}_resume.pth`` (ours, or one written by original
    MiniMind: chosen, a line says so; ours whose ``.ckpt`` is gone is skipped with a line:
    :func:`usable_resume_link`). The newest save wins, as Lightning's own ``last`` does; a damaged file is skipped with a
    warning naming it and why. When files exist but none is usable it raises (never a silent fresh start).
    ``verify=False``: the newest candidate, unread (what a DDP rank other than 0 looks at).
    """
    ckpt_dir = Path(ckpt_dir)
    candidates = CheckpointName.find(ckpt_dir, stem)
    minimind_resume = ckpt_dir / minimind_file_names(stem)[1]
    if minimind_resume.exists() and usable_resume_link(minimind_resume, stem):
        candidates.append(minimind_resume)
    problems = []
    for path in sorted(candidates, key=save_order_key, reverse=True):
        if not verify:
            return path
        try:
            verify_checkpoint(path)
        except CheckpointError as err:
            rank_zero_warn(f"skipping checkpoint {err}")
            problems.append(str(err))
            continue
        if path == minimind_resume and (kind := describe_resume_link(path, stem)):
            rank_zero_info(kind)
        return path
    if problems:
        raise CheckpointError(
            f"--ckpt_path last: no usable checkpoint for {stem} in {ckpt_dir}/ - every candidate is damaged:\n  "
            + "\n  ".join(problems)
            + "\nThe files are left untouched. To start fresh anyway, run without --ckpt_path "
            "(a fresh run does not overwrite them) or move them away."
        )
    return None


def choose_checkpoint(flag: str | None, ckpt_dir: str | Path, stem: str, global_rank: int) -> str | None:
    """``--ckpt_path`` as this process sees it before the DDP process group exists: global rank 0 turns
    ``last`` into the newest valid file (reading it whole: CRC) or checks a given file; another rank only
    looks whether there is one, without reading it: every rank loads rank 0's choice
    (:func:`agree_on_checkpoint`). ``None``: start fresh."""
    if not flag:
        return None
    if flag == "last":
        found = resolve_last(ckpt_dir, stem, verify=global_rank == 0)
        if found is None:
            rank_zero_warn(f"--ckpt_path last: no checkpoint for {stem} in {ckpt_dir}/ yet; starting fresh")
            return None
        return str(found)
    if not Path(flag).is_file():
        raise CheckpointError(f"{flag}: no such checkpoint file (--ckpt_path)")
    return flag


def agree_on_checkpoint(trainer: Any, local: str | None) -> str | None:
    """Every rank's checkpoint: global rank 0's ``local`` choice (one broadcast; call it on every rank
    once the process group exists). Ranks that saw another file (a shared filesystem's stale cache, a
    prune in between) say so and load rank 0's; ranks that disagree on whether there is a checkpoint
    at all stop together with one line (a fresh start on some ranks and a resume on others would
    silently diverge)."""
    if trainer.world_size == 1:
        return local
    local = os.path.abspath(local) if local is not None else None  # ranks may run in other directories
    chosen = trainer.strategy.broadcast(local, src=0)
    differs = torch.tensor([float((chosen is None) != (local is None))], device=trainer.strategy.root_device)
    if trainer.strategy.reduce(differs, reduce_op="max").item() > 0:
        raise CheckpointError(
            f"--ckpt_path: global rank 0 {'found no checkpoint' if chosen is None else f'chose {chosen}'}, but "
            "another rank sees otherwise in its checkpoint directory; every rank must see the same files "
            "(a shared filesystem still syncing?): run the same command again")
    if local != chosen:
        print(f"[rank {trainer.global_rank}] --ckpt_path: this rank saw {local} as the newest checkpoint; "
              f"loading global rank 0's choice {chosen}", file=sys.stderr, flush=True)
    return chosen


# ----------------------------------------------------------------------------- several runs in one directory

def run_of(path: Path) -> str | None:
    """The run id of one of our checkpoints: its manifest's, else the one in its name."""
    run_id = read_manifest(path).get("run_id")
    if run_id:
        return str(run_id)
    name = CheckpointName.parse(path.name)
    return name.run_id if name else None


def prune_runs(ckpt_dir: Path, stem: str, run_id: str, keep_runs: int) -> list[Path]:
    """Delete every ``{stem}`` checkpoint (and its manifest) of the runs older than the newest
    ``keep_runs`` (a run's age: its newest save); ``run_id``'s are never deleted. Returns what was removed."""
    runs: dict[str, list[Path]] = {}
    for path in CheckpointName.find(ckpt_dir, stem):
        other = run_of(path)
        if other is not None:
            runs.setdefault(other, []).append(path)
    newest_first = sorted(runs, key=lambda r: max(save_order_key(p) for p in runs[r]), reverse=True)
    kept = [run_id, *[r for r in newest_first if r != run_id]][:keep_runs]
    removed = [p for r in newest_first if r not in kept for p in runs[r]]
    for path in removed:
        remove_file(path)
    if removed:
        older = sorted({run_of(p) or "?" for p in removed})
        print(f"checkpoints: --resume.keep_runs {keep_runs}: removed {len(removed)} checkpoint(s) of {len(older)} older "
              f"run(s) ({', '.join(older)}) from {ckpt_dir}/", flush=True)
    return removed


def _pickle_mentions(path: Path, marker: bytes) -> bool:
    """Whether the main pickle of a ``torch.save`` file (its ``data.pkl``, small: tensors live apart) holds ``marker``."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as archive:
            name = next((n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"), None)
            return name is not None and marker in archive.read(name)
    except (zipfile.BadZipFile, OSError):
        return False


def _position_in_file(path: Path) -> dict[str, Any]:
    """epoch, step, global_step and run id read from a Lightning dict (no manifest to read them from)."""
    import torch

    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - damaged: verification says why
        return {}
    state = ((ckpt.get("callbacks") or {}).get(RESUME_STATE_KEY) or {}) if isinstance(ckpt, dict) else {}
    return {"epoch": ckpt.get("epoch"), "step": ckpt.get("step"), "global_step": ckpt.get("global_step"),
            "run_id": state.get("run_id")} if state.get("run_id") else {}


def resume_link(path: Path, stem: str) -> tuple[str, Path | None]:
    """What ``{stem}_resume.pth`` is: ``("ours", the .ckpt it links)`` (its manifest, else its dict, names the
    save and run), ``("lightning", None)`` (a Lightning dict ResumeCallback did not write) or
    ``("minimind", None)`` (original MiniMind's: no manifest, MiniMind's keys only)."""
    manifest = read_manifest(path)
    position = manifest if manifest.get("run_id") else {}
    if not position and (manifest.get("kind") == "lightning" or _pickle_mentions(path, b"pytorch-lightning_version")):
        position = _position_in_file(path)
        if not position:
            return "lightning", None
    if not position:
        return "minimind", None
    return "ours", path.parent / str(CheckpointName.of(stem, position))


def usable_resume_link(path: Path, stem: str) -> bool:
    """``--ckpt_path last`` takes ``{stem}_resume.pth`` unless it is ours and its ``.ckpt`` is gone (the run's
    checkpoints were deleted: it is no live run's), said in one line."""
    kind, target = resume_link(path, stem)
    if kind == "ours" and target is not None and not target.exists():
        rank_zero_warn(f"--ckpt_path last: skipping {path}: a link to {target.name}, which no longer exists (that "
                       f"run's checkpoints were deleted); to resume from it anyway: --ckpt_path {path}")
        return False
    return True


def describe_resume_link(path: Path, stem: str) -> str | None:
    """The line saying which kind of ``_resume.pth`` ``--ckpt_path last`` chose (None: ours, said elsewhere)."""
    kind, _ = resume_link(path, stem)
    if kind == "minimind":
        return f"--ckpt_path last: {path} is original MiniMind's resume checkpoint (no manifest, MiniMind's keys only)"
    if kind == "lightning":
        return f"--ckpt_path last: {path} is a Lightning checkpoint ResumeCallback did not write (no run id)"
    return None
