"""The start of a run, chosen once and restored: which checkpoint ``--ckpt_path`` / ``ckpt_path="last"`` means,
read and verified once (:class:`Start`, used by the CLI and by ``trainer.fit(ckpt_path="last")`` alike), every
DDP rank agreeing on global rank 0's choice, and what a restore completes that Lightning does not (the position
of a foreign checkpoint as loop counters, this rank's RNG). A URL checkpoint directory adds
:mod:`lit_minimind.resume.remote` (imported only then); a save never loads this module.

``last`` is the newest valid checkpoint of the stem (by its manifest's save time): ours, or MiniMind's
``{stem}_resume.pth``, which may be ours, another Lightning run's or original MiniMind's (:func:`resume_link`).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info

from lit_minimind.checkpoint.atomic import read_manifest, save_order_key
from lit_minimind.checkpoint.names import RESUME_STATE_KEY, TRAINING_STATE_KEY, CheckpointName, minimind_file_names
from lit_minimind.checkpoint.read import read_checkpoint, verify_checkpoint, verify_manifest
from lit_minimind.errors import CheckpointError, say
from lit_minimind.resume.internals import adopt_scaler_state, loops_at
from lit_minimind.resume.manager import CheckpointFiles
from lit_minimind.resume.states import (
    optimizer_steps,
    rank_rng_state,
    window_complete,
    world_size_change,
)


@dataclass
class Start:
    """The checkpoint a run starts from, chosen once, used by the CLI, the loggers and Lightning's restore alike.
    ``path``: the file (before setup: this rank's choice; at setup every rank takes global rank 0's); ``ckpt``: on
    global rank 0 its verified read, which the loggers and Lightning's restore take instead of reading the file
    again (None on other ranks); ``agreed``: another rank's start at setup, global rank 0's file, whose bytes rank 0
    verified (Lightning may name a stand-in path for it: ``CheckpointManager.last``)."""

    path: str
    ckpt: dict[str, Any] | None = None
    agreed: bool = False

    def load(self, path: str | os.PathLike, map_location: Any = None) -> dict[str, Any] | None:
        """What Lightning's restore loads for ``path`` (``SafeCheckpointIO.load_checkpoint``): the read already made,
        or rank 0's file unverified on another rank; None when this start does not answer for ``path``."""
        if self.agreed:
            return read_checkpoint(self.path, map_location or "cpu", verify=False)
        if self.ckpt is not None and os.path.abspath(path) == os.path.abspath(self.path) and map_location in (None, "cpu"):
            return self.ckpt
        return None

    def restores_rng(self) -> bool:
        """Whether it holds global rank 0's RNG state (ours; not an original MiniMind file)."""
        return self.ckpt is not None and rank_rng_state(self.ckpt.get(TRAINING_STATE_KEY) or {}, 0) is not None


def choose(flag: str | None, files: CheckpointFiles, stem: str, global_rank: int, remote: Any = None,
           ours: dict[str, Any] | None = None) -> Start | None:
    """``--ckpt_path`` (``last``, a file or None) as a :class:`Start`: global rank 0 reads the chosen file
    (verified) once; another rank only looks (:func:`choose_checkpoint`). With a URL directory (``remote``:
    :class:`lit_minimind.resume.remote.RemoteCheckpoints`) ``last`` may first download the remote's newest."""
    if remote is not None:
        chosen = remote.choose(flag, files.ckpt_dir, stem, global_rank, ours)
    else:
        chosen = choose_checkpoint(flag, files.ckpt_dir, stem, global_rank, ours)
    if chosen is None:
        return None
    return Start(chosen, read_checkpoint(chosen, "cpu") if global_rank == 0 else None)


def another_run(path: Path, ours: dict[str, Any] | None) -> dict[str, Any] | None:
    """The identity a checkpoint's manifest records (its data by name and size, batch size, layers:
    ``CheckpointManager.identity_of``) when it is not ``ours``: another run's file under the same stem; None when it is ours or cannot tell (a file
    written before identities were recorded, original MiniMind's)."""
    manifest = read_manifest(path) if ours else {}
    theirs = manifest.get("identity")
    if not theirs or all(theirs.get(k) == v for k, v in ours.items() if k in theirs and k != "data"):  # data: shown
        return None
    return {**theirs, "saved_at": manifest.get("saved_at"), "file": path.name}


def describe_run(identity: dict[str, Any]) -> str:
    """``data my.jsonl, batch size 16, 2 layers``, and when it was saved where known."""
    data = identity.get("data") or "the embedded corpus"
    text = f"data {data}, batch size {identity.get('batch_size')}, {identity.get('layers')} layers"
    if identity.get("saved_at"):
        text += ", saved " + time.strftime("%Y-%m-%d %H:%M", time.localtime(int(identity["saved_at"]) / 1e9))
    return text


def run_flags(identity: dict[str, Any]) -> str:
    """The flags that give a run this identity's data and batch size."""
    data = f"--data.data_path {identity['data']}" if identity.get("data") else "no --data.data_path (the embedded corpus)"
    return f"{data} --data.batch_size {identity.get('batch_size')}"


def resolve_last(ckpt_dir: str | Path, stem: str, verify: bool = True, ours: dict[str, Any] | None = None) -> Path | None:
    """The most recently saved valid resume checkpoint of ``stem`` in ``ckpt_dir``; ``None`` when there
    is none at all.

    Candidates: our checkpoints and MiniMind's ``{stem}_resume.pth`` (ours, or one written by original
    MiniMind: chosen, a line says so; ours whose ``.ckpt`` is gone is skipped with a line:
    :func:`usable_resume_link`). The newest save wins, as Lightning's own ``last`` does; a damaged file is skipped with a
    warning naming it and why. When files exist but none is usable it raises (never a silent fresh start).
    ``verify=False``: the newest candidate, unread (what a DDP rank other than 0 looks at).

    ``ours``: this run's identity (``CheckpointManager.identity_of``): another run's checkpoints under the same stem
    (other data, batch size or depth) are passed over, said in one line; with only another run's, the newest is
    chosen as before (the DataModule and the module refuse what does not fit, naming each field), after a line
    naming that run and the two ways on.
    """
    ckpt_dir = Path(ckpt_dir)
    candidates = CheckpointName.find(ckpt_dir, stem)
    minimind_resume = ckpt_dir / minimind_file_names(stem)[1]
    if minimind_resume.exists() and usable_resume_link(minimind_resume, stem):
        candidates.append(minimind_resume)
    problems, others = [], []
    for path in sorted(candidates, key=save_order_key, reverse=True):
        if not verify:
            return path
        if (theirs := another_run(path, ours)) is not None:
            others.append(theirs)
            continue
        try:
            verify_checkpoint(path)
        except CheckpointError as err:
            say(f"skipping checkpoint {err}")
            problems.append(str(err))
            continue
        if path == minimind_resume and (kind := describe_resume_link(path, stem)):
            rank_zero_info(kind)
        if others:
            say(f"--ckpt_path last: passing over the newer checkpoints of another run in {ckpt_dir}/ "
                f"({describe_run(others[0])}): resuming this run's {path.name}")
        return path
    if others:  # only another run's: its newest, as before, said first (the restore refuses what does not fit)
        assert ours is not None
        say(f"--ckpt_path last: the newest checkpoint for {stem} in {ckpt_dir}/ is another run's "
            f"({describe_run(others[0])}), not this run's ({describe_run(ours)}). Either resume that run with its flags "
            f"({run_flags(others[0])} --ckpt_path last), or start this one fresh: run without --ckpt_path (that run's "
            f"checkpoints stay; the fp16 export {stem}.pth, MiniMind's name for it, would be replaced)")
        return resolve_last(ckpt_dir, stem, verify)
    if problems:
        raise CheckpointError(
            f"--ckpt_path last: no usable checkpoint for {stem} in {ckpt_dir}/ - every candidate is damaged:\n  "
            + "\n  ".join(problems)
            + "\nThe files are left untouched. To start fresh anyway, run without --ckpt_path "
            "(a fresh run does not overwrite them) or move them away."
        )
    return None


def choose_checkpoint(flag: str | None, ckpt_dir: str | Path, stem: str, global_rank: int,
                      ours: dict[str, Any] | None = None) -> str | None:
    """``--ckpt_path`` as this process sees it before the DDP process group exists: global rank 0 turns
    ``last`` into the newest valid file (reading it whole: CRC) or checks a given file; another rank only
    looks whether there is one, without reading it: every rank loads rank 0's choice
    (:func:`agree_on_checkpoint`). ``None``: start fresh."""
    if not flag:
        return None
    if flag == "last":
        found = resolve_last(ckpt_dir, stem, verify=global_rank == 0, ours=ours)
        if found is None:
            say(f"--ckpt_path last: no checkpoint for {stem} in {ckpt_dir}/ yet; starting fresh")
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


# ----------------------------------------------------------------------------- after Lightning's restore

def restore(trainer: Any, checkpoint: dict[str, Any], state_key: str) -> tuple[dict[str, Any] | None, Any]:
    """In ``on_load_checkpoint`` (Lightning restored the DataModule's position already): complete what a
    foreign checkpoint lacks (loop counters of an original MiniMind file or of a changed world size), say
    where the run resumes, and return ``(where it resumed from, this rank's saved RNG state)``;
    ``(None, None)`` for a Lightning checkpoint written without our DataModule (Lightning restores what it can)."""
    adopt_scaler_state(checkpoint, trainer.precision_plugin)  # written under another precision plugin
    datamodule = trainer.datamodule
    position, saved = getattr(datamodule, "position", None), getattr(datamodule, "saved_position", None)
    if position is None or saved is None:
        return None, None
    saved_world, world = int(saved.get("world_size") or 1), trainer.world_size
    change = world_size_change(int(saved["step"]), saved_world, world, position.step)
    if change:
        rank_zero_info(change)
    translated = saved_world != world or position.step != int(saved["step"])
    accumulate = trainer.accumulate_grad_batches
    if checkpoint.get("loops") is None or translated:
        if checkpoint.get("global_step") is None or saved_world != world:
            # an original MiniMind file, or steps of another world size: this world's optimizer steps up to
            # the position, so --trainer.max_steps and the LR schedule count one kind of step
            steps_here = optimizer_steps(position, accumulate)
            if checkpoint.get("global_step") is not None and trainer.max_steps > 0:
                rank_zero_info(f"global step {checkpoint['global_step']} on {saved_world} → {steps_here} on {world} "
                               f"process(es); --trainer.max_steps {trainer.max_steps} counts optimizer steps of "
                               f"{world} process(es): training and its LR schedule end at step {trainer.max_steps}")
            checkpoint["global_step"] = steps_here
        checkpoint["loops"] = loops_at(trainer.fit_loop.state_dict(), position, accumulate, checkpoint["global_step"])
    rank_zero_info(position.describe())
    source = (checkpoint.get("callbacks") or {}).get(state_key, {}).get("source_format", "lightning")
    resumed_from = {"epoch": position.epoch, "step": position.step, "saved_step": int(saved["step"]),
                    "world_size": saved_world, "global_step": checkpoint["global_step"], "source": source}
    if not window_complete(position.step, position.iters, accumulate):  # a MiniMind file, an older one of ours
        say(f"the checkpoint was saved inside an accumulation window (step {position.step}, "
                       f"{accumulate} batches per optimizer step) and holds no partial gradients (as MiniMind's "
                       "own resume): this window's optimizer step sums only the batches from here")
    return resumed_from, rank_rng_state(checkpoint.get(TRAINING_STATE_KEY) or {}, trainer.global_rank)


def published(files: CheckpointFiles, checkpoint: Path, stem: str) -> bool:
    """MiniMind's two files hold this checkpoint's save (not one a kill left behind)."""
    keys = ("epoch", "step", "global_step", "run_id")
    saved = read_manifest(checkpoint)
    for path in (files.export(stem), files.resume(stem)):
        if not path.exists() or any(saved.get(k) != read_manifest(path).get(k) for k in keys):
            return False
        if os.path.samefile(path, checkpoint):
            continue  # the link to the checkpoint itself, whose bytes were verified (not read again)
        try:
            verify_manifest(path, accept_replaced=False)
        except CheckpointError:
            return False
    return True


# ----------------------------------------------------------------------------- MiniMind's _resume.pth

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
        say(f"--ckpt_path last: skipping {path}: a link to {target.name}, which no longer exists (that "
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
