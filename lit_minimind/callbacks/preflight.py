"""Pre-flight: before the first batch, every directory the run will write is checked.

A read-only or full ``--resume.ckpt_dir`` would otherwise show only at the first save, after
``save_interval`` batches trained for nothing. Checked, on global rank 0, before anything is created:

* the checkpoint directory (``ResumeCallback.files.ckpt_dir``: the local staging one of a URL
  directory), the fp16 export directory (``files.out_dir``) and every logger's directory
  (``root_dir``, else ``save_dir``): each is a directory, or can be made in its nearest existing
  parent, which is a directory and writable: a directory made there and removed at once (root passes
  ``os.access`` everywhere, ``/proc`` included); a read-only filesystem named as such;
* free space for one save on each filesystem (``shutil.disk_usage``; directories on one filesystem add up;
  one that reports no size at all is not checked):
  the checkpoint holds the weights, AdamW's two moments per trainable parameter and MiniMind's fp16 copy
  (``params x (4 + 8 + 2)`` bytes in fp32), the export ``params x 2``, each plus 10 % and 1 MiB, a logger 1 MiB;
* a URL directory (:mod:`lit_minimind.resume.remote`) of a fresh run: its bucket looked up once;
  a bucket that does not exist or denies access stops the run, one that does not answer is said in one
  line (training goes on, its uploads are retried, as in the rest of the run).

A problem raises :class:`lit_minimind.errors.CheckpointError` (the CLI prints it as one ``error:``
line, exit 2) naming the directory and the problem. ``python -m lit_minimind.fit`` checks before
``trainer.fit`` (:func:`check_run_dirs`), so a failed check leaves nothing behind;
:meth:`lit_minimind.callbacks.ResumeCallback.setup` checks (:func:`check_at_setup`) when that did not
happen (a script of yours): Lightning has created its loggers' version directories by then, and a failed
check removes those it left empty.
"""

from __future__ import annotations

import errno
import os
import shutil
import sys
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L

from lit_minimind.errors import CheckpointError

MIB = 1 << 20
MARGIN = 0.10  # of a save's estimated size, plus MARGIN_BYTES: Lightning's own keys, the manifests, the pickle
MARGIN_BYTES = MIB
LOG_BYTES = MIB  # a logger's directory: room for its first rows

_passed: weakref.WeakSet[Any] = weakref.WeakSet()  # trainers whose run was checked before trainer.fit


@dataclass
class Need:
    """``flag`` (how the user names it) wants ``directory`` written, ``size`` bytes in it."""

    flag: str
    directory: Path
    size: int
    what: str


def save_sizes(pl_module: L.LightningModule) -> tuple[int, int]:
    """Estimated bytes of one checkpoint and of one fp16 export of ``pl_module`` (no optimizer exists yet:
    AdamW's two moments per trainable parameter, in the parameter's dtype)."""
    weights = moments = count = 0
    for p in pl_module.parameters():
        weights += p.numel() * p.element_size()
        moments += 2 * p.numel() * p.element_size() if p.requires_grad else 0
        count += p.numel()
    fp16 = 2 * count  # MiniMind's "model" key in the checkpoint, and the export
    return weights + moments + fp16, fp16


def _with_margin(size: int) -> int:
    return int(size * (1 + MARGIN)) + MARGIN_BYTES


def logger_dirs(trainer: L.Trainer) -> list[tuple[str, Path]]:
    """Each logger's directory, named as a user knows it; read without choosing a version (``log_dir`` would)."""
    found = []
    for logger in trainer.loggers:
        for attr in ("root_dir", "save_dir"):
            try:
                value = getattr(logger, attr, None)
            except Exception:  # noqa: BLE001 - a logger's property that needs its experiment
                value = None
            if value:
                found.append((f"the {type(logger).__name__}'s log directory", Path(os.fspath(value))))
                break
    return found


def needs(trainer: L.Trainer, pl_module: L.LightningModule, resume: Any) -> list[Need]:
    checkpoint, export = save_sizes(pl_module)
    mb = f"{_mb(checkpoint)} MB"
    return [
        Need("--resume.ckpt_dir", Path(resume.files.ckpt_dir), _with_margin(checkpoint),
             f"one checkpoint ~{mb}: fp32 weights, AdamW's 2 moments and an fp16 copy"),
        Need("--resume.out_dir", Path(resume.files.out_dir), _with_margin(export), f"the fp16 export ~{_mb(export)} MB"),
        *(Need(flag, path, LOG_BYTES, "its logs") for flag, path in logger_dirs(trainer)),
    ]


def _mb(size: int) -> str:
    return f"{size / MIB:,.0f}" if size >= 10 * MIB else f"{size / MIB:,.1f}"


def _existing(directory: Path) -> Path:
    """``directory`` or its nearest existing parent (what ``mkdir -p`` would start from)."""
    path = directory.absolute()
    while not os.path.lexists(path) and path != path.parent:
        path = path.parent
    return path


def _not_writable(start: Path) -> str | None:
    """Why nothing can be made in the existing directory ``start``, or None. ``os.access`` first, then a real
    try (a directory made and removed at once): root passes ``os.access`` everywhere, ``/proc`` and ``/sys``
    included, whose ``disk_usage`` then reads 0 bytes free - a full disk it is not."""
    read_only = bool(os.statvfs(start).f_flag & os.ST_RDONLY)
    if not os.access(start, os.W_OK | os.X_OK):
        return "read-only file system" if read_only else "permission denied"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".lit-minimind-preflight-", dir=start))
    except OSError as err:
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            return None  # writable but full: the free-space check names what is free and what is needed
        if read_only or err.errno == errno.EROFS:
            return "read-only file system"
        if os.statvfs(start).f_blocks == 0:  # /proc (ENOENT), /sys (EPERM): no storage behind it
            return "a virtual file system, no storage"
        if err.errno in (errno.EACCES, errno.EPERM):
            return "permission denied"
        return (err.strerror or type(err).__name__).lower()
    return None


def problem(directories: list[Need]) -> str | None:
    """The first thing that stops the run, as one line naming the directory; None when every one is fine."""
    by_filesystem: dict[int, list[tuple[Need, Path]]] = {}
    for need in directories:
        start = _existing(need.directory)
        where = f"{need.flag} {need.directory}"
        if not start.is_dir():
            what = "a file" if start.exists() else "a broken link"
            it = "it" if start == need.directory.absolute() else str(start)
            return f"{where}: not a directory ({it} is {what}); nothing was started"
        why = _not_writable(start)
        if why:
            at = "" if start == need.directory.absolute() else f" (cannot create it in {start})"
            return f"{where}: not writable: {why}{at}; nothing was started - choose a writable directory"
        by_filesystem.setdefault(start.stat().st_dev, []).append((need, start))
    for group in by_filesystem.values():
        wanted = sum(need.size for need, _ in group)
        usage = shutil.disk_usage(group[0][1])
        free = usage.free
        if usage.total and free < wanted:  # total 0: a file system that reports no size (tmpfs size=0, some FUSE)
            names = " and ".join(f"{need.flag} {need.directory}" for need, _ in group)
            parts = "; ".join(need.what for need, _ in group)
            return (f"{names}: {_mb(free)} MB free on {'their' if len(group) > 1 else 'its'} file system, "
                    f"~{_mb(wanted)} MB needed ({parts}; +{MARGIN:.0%} margin); nothing was started - "
                    "free space or choose another directory")
    return None


def remote_problem(resume: Any) -> str | None:
    """A fresh run's URL directories: each bucket (the first part of the path) looked up once. Does not
    exist, or access denied: the line that stops the run. No answer: said here, None (training goes on)."""
    remote = getattr(resume, "remote", None)
    for flag, directory in (("--resume.ckpt_dir", getattr(remote, "ckpt", None)), ("--resume.out_dir", getattr(remote, "out", None))):
        if directory is None:
            continue
        protocols = directory.fs.protocol if isinstance(directory.fs.protocol, (tuple, list)) else (directory.fs.protocol,)
        if "file" in protocols or "local" in protocols:  # file:// - a local directory after all
            found = problem([Need(flag, Path(directory.root), 0, "")])
            if found:
                return found
            continue
        bucket = directory.root.split("/", 1)[0]
        try:
            directory.fs.info(bucket)
        except FileNotFoundError:
            return f"{flag} {directory.url}: the bucket {bucket} does not exist; nothing was started"
        except PermissionError as err:
            return f"{flag} {directory.url}: access denied ({_first_line(err)}): check the credentials; nothing was started"
        except Exception as err:  # noqa: BLE001 - endpoint down, timeouts, missing credentials
            if type(err).__name__ in ("NoCredentialsError", "PartialCredentialsError"):
                return f"{flag} {directory.url}: no credentials ({_first_line(err)}); nothing was started"
            print(f"remote: {directory.url} does not answer now ({type(err).__name__}: {_first_line(err)}); training "
                  "starts, its uploads are retried", file=sys.stderr, flush=True)
    return None


def _first_line(err: BaseException) -> str:
    return str(err).splitlines()[0] if str(err) else type(err).__name__


def check_run_dirs(trainer: L.Trainer, pl_module: L.LightningModule, resume: Any, fresh: bool) -> None:
    """Before ``trainer.fit`` (nothing created yet), on global rank 0: raise :class:`CheckpointError` for the
    first directory that cannot take the run's files (``fresh``: no checkpoint to start from, so the
    remote's bucket is looked up here; a resume's listing does that). :func:`check_at_setup` then passes."""
    if not trainer.is_global_zero:
        return
    found = problem(needs(trainer, pl_module, resume)) or (remote_problem(resume) if fresh else None)
    if found:
        raise CheckpointError(found)
    _passed.add(trainer)


def check_at_setup(trainer: L.Trainer, pl_module: L.LightningModule, resume: Any) -> None:
    """At ``ResumeCallback.setup`` (every rank; the process group exists): global rank 0 checks unless
    :func:`check_run_dirs` did for this fit, and every rank stops together on its line. The loggers'
    directories Lightning created before setup are removed when left empty, and the loggers dropped,
    so that a failed check leaves nothing behind."""
    found = None
    if trainer.is_global_zero and trainer not in _passed:
        found = problem(needs(trainer, pl_module, resume))
        if found is None and trainer.ckpt_path is None:
            found = remote_problem(resume)
    _passed.discard(trainer)
    if trainer.world_size > 1:
        found = trainer.strategy.broadcast(found, src=0)
    if not found:
        return
    if trainer.is_global_zero:
        _remove_empty_log_dirs(trainer)
    trainer.loggers = []  # nothing finalized into them on the way out
    raise CheckpointError(found)


def _remove_empty_log_dirs(trainer: L.Trainer) -> None:
    for logger in trainer.loggers:
        try:
            log_dir = getattr(logger, "log_dir", None)
        except Exception:  # noqa: BLE001
            continue
        for path in (log_dir, getattr(logger, "root_dir", None)):
            if path:
                try:
                    os.rmdir(path)  # only an empty directory
                except OSError:
                    pass
