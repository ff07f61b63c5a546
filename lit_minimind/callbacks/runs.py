"""Several runs' files in one checkpoint directory: which run a file belongs to, what ``_resume.pth`` is,
and ``--resume.keep_runs``.

Each save's ``.ckpt`` carries its run's id (in its name and manifest, kept across resumes). ``keep_last``
is per run: each run keeps its own newest ``keep_last`` and never prunes another run's files, so a
directory holding many runs grows with every fresh run; ``keep_runs N`` bounds it: at a run's first save
the checkpoints of all but the newest ``N`` runs (this one included, never removed) are deleted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch.utilities import rank_zero_warn

from lit_minimind.checkpoint.atomic import read_manifest, remove_file
from lit_minimind.checkpoint.names import RESUME_STATE_KEY, CheckpointName


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
    from lit_minimind.callbacks.files import save_order_key

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
