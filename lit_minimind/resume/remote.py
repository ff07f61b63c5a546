"""Remote checkpoint directories (``--resume.ckpt_dir`` / ``--resume.out_dir`` as fsspec URLs).

A save goes to a local staging directory first (``checkpoints/`` and ``out/`` in the working
directory: the existing atomic local save, the fast path a resume on the same node uses); after its
commit there, the background :class:`lit_minimind.resume.upload.Uploader` mirrors it: the Lightning
checkpoint uploaded, verified and committed by its manifest object, MiniMind's ``{stem}_resume.pth``
as a server-side copy of it, the fp16 export ``{stem}.pth`` uploaded to the remote out directory,
then the remote's retention. ``--ckpt_path last`` downloads the newest committed remote checkpoint
when no local one is newer.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

from lit_minimind.checkpoint.atomic import read_manifest
from lit_minimind.checkpoint.names import CheckpointName, is_url, minimind_file_names
from lit_minimind.checkpoint.remote import RemoteDir
from lit_minimind.errors import CheckpointError, say
from lit_minimind.resume.start import choose_checkpoint, resolve_last
from lit_minimind.resume.upload import UPLOAD_DIR, Uploader, describe, link_for_upload

REMOTE_BEHIND_EXIT = 5  # training ended, but the remote does not hold the newest checkpoint
STAGING = {"ckpt_dir": "checkpoints", "out_dir": "out"}  # local staging directories of remote ones
_LABEL = ("epoch", "step", "global_step")


def staging_dir(flag: str, value: str) -> str:
    """The local directory a ``--resume.{flag}`` value is written to: itself, or for a URL the staging one."""
    return STAGING[flag] if is_url(value) else value


class RemoteCheckpoints:
    """The remote side of a run's checkpoint files: what to upload after a save, what to fetch at start."""

    def __init__(self, ckpt_url: str | None, out_url: str | None, keep_last: int) -> None:
        self.ckpt = RemoteDir(ckpt_url, "--resume.ckpt_dir") if ckpt_url else None
        self.out = RemoteDir(out_url, "--resume.out_dir") if out_url else None
        self.keep_last = keep_last
        self._offered = False
        self.uploader = Uploader((self.ckpt or self.out).url)  # type: ignore[union-attr]

    @classmethod
    def of(cls, ckpt_dir: str, out_dir: str, keep_last: int) -> RemoteCheckpoints | None:
        ckpt, out = (str(d) if is_url(str(d)) else None for d in (ckpt_dir, out_dir))
        return cls(ckpt, out, keep_last) if ckpt or out else None

    # ------------------------------------------------------------------ after a save
    def offer(self, checkpoint: Path, export: Path, stem: str, run_id: str) -> None:
        """Queue the upload of a save committed locally (called on the writer thread, after its files):
        hard links to its files are made now, so a later save or the local retention cannot change them."""
        if not self._offered:  # links a killed run left behind
            for directory in {checkpoint.parent, export.parent}:
                shutil.rmtree(directory / UPLOAD_DIR, ignore_errors=True)
            self._offered = True
        manifest = read_manifest(checkpoint)
        tag = f"{os.getpid()}-{time.monotonic_ns()}"
        steps: list[list[Any]] = []
        links: list[str] = []
        commit = 0  # the step that commits the save on the remote: the checkpoint's upload
        if self.ckpt is not None:
            link = str(link_for_upload(checkpoint, tag))
            links.append(link)
            steps.append(["upload", self.ckpt.url, link, checkpoint.name, manifest])
            steps.append(["copy", self.ckpt.url, checkpoint.name, minimind_file_names(stem)[1], manifest])
        if self.out is not None and export.exists():
            link = str(link_for_upload(export, tag))
            links.append(link)
            steps.append(["upload", self.out.url, link, export.name, read_manifest(export)])
        if self.ckpt is not None:
            steps.append(["prune", self.ckpt.url, CheckpointName.pattern(stem), run_id, self.keep_last])
        self.uploader.offer({k: manifest.get(k) for k in _LABEL}, steps, links, commit)

    # ------------------------------------------------------------------ at start
    def newest(self, stem: str) -> list[tuple[str, dict[str, Any]]]:
        """Committed remote checkpoints of ``stem``, newest first (raises a one-line error when unreachable)."""
        if self.ckpt is None:
            return []
        try:
            return self.ckpt.list(CheckpointName.pattern(stem))
        except Exception as err:  # noqa: BLE001 - endpoint down, no bucket, no permission
            raise CheckpointError(f"cannot list {self.ckpt.url} ({type(err).__name__}: "
                                  f"{str(err).splitlines()[0] if str(err) else ''})") from None

    def fetch_newer(self, local_dir: Path, stem: str) -> Path | None:
        """Download the newest committed remote checkpoint newer than every local one (a damaged one is
        skipped with a warning, the next one tried); None when a local one is as new or none is on the remote.
        The remote unreachable: the local checkpoint is used (with a warning); with none, a one-line error
        (never a silent fresh start over the bucket's checkpoints)."""
        local = resolve_last(local_dir, stem, verify=False) if Path(local_dir).is_dir() else None
        try:
            candidates = self.newest(stem)
        except CheckpointError as err:
            if local is None:
                raise CheckpointError(f"--ckpt_path last: {err} and there is no local checkpoint: nothing was "
                                      "started; run again when the remote answers") from None
            say(f"--ckpt_path last: {err}; resuming from the local checkpoints in {local_dir}/ "
                           "(the remote may hold a newer one)")
            return None
        if candidates:
            self.uploader.holds = {k: candidates[0][1].get(k) for k in _LABEL}
        local_at = int(read_manifest(local).get("saved_at") or 0) if local is not None else -1
        assert self.ckpt is not None or not candidates
        for name, manifest in candidates:
            if int(manifest.get("saved_at") or 0) <= local_at:
                return None
            target = Path(local_dir) / name
            try:
                self.ckpt.download(name, manifest, target)  # type: ignore[union-attr]
            except CheckpointError as err:
                say(f"skipping remote checkpoint {err}")
                continue
            print(f"remote: downloaded {self.ckpt.where(name)} ({describe(manifest)}, CRC-32 checked)",  # type: ignore[union-attr]
                  flush=True)
            return target
        return None

    def offer_if_newer(self, checkpoint: Path, export: Path, stem: str, run_id: str) -> None:
        """The run starts from a local checkpoint newer than the remote's newest: it is uploaded too."""
        if self.ckpt is None or checkpoint.suffix != ".ckpt":
            return
        try:
            newest = self.newest(stem)
        except CheckpointError:
            newest = []  # unreachable now: the uploader retries; an upload already committed is skipped
        if not newest or int(newest[0][1].get("saved_at") or 0) < int(read_manifest(checkpoint).get("saved_at") or 0):
            self.offer(checkpoint, export, stem, run_id)

    # ------------------------------------------------------------------ at the end
    def finish(self, timeout: float) -> bool:
        """Wait (bounded) for the newest save's upload; True when the remote holds it."""
        if self.uploader.latest is not None and self.uploader.latest != self.uploader.holds:
            print(f"remote: waiting up to {timeout:g} s for the upload of {describe(self.uploader.latest)} "
                  "(--resume.upload_timeout)", flush=True)
        return self.uploader.finish(timeout)

    def summary(self) -> str:
        held, latest = self.uploader.summary_label("holds"), self.uploader.summary_label("latest")
        behind = "" if latest is None or held == latest else f" - BEHIND: the newest save is {describe(latest)}"
        return f"remote checkpoints: {self.uploader.where} holds {describe(held)}{behind}"

    def behind_line(self) -> str:
        return (f"error: the remote {self.uploader.where} holds {describe(self.uploader.holds)}, not the newest "
                f"save ({describe(self.uploader.latest)}, kept locally in {STAGING['ckpt_dir']}/); "
                "rerun with --ckpt_path last on this machine to upload it")


    # ------------------------------------------------------------------ the start
    def choose(self, flag: str | None, ckpt_dir: str | Path, stem: str, global_rank: int,
               ours: dict[str, Any] | None = None) -> str | None:
        """:func:`lit_minimind.resume.start.choose_checkpoint`, the remote included: for ``last`` global rank 0 first
        downloads the newest committed remote checkpoint when it is newer than every local one (a local
        one newer than the remote's wins, and is uploaded at the start). Another rank only looks whether
        there is a checkpoint anywhere; every rank then loads rank 0's choice."""
        if flag != "last" or self.ckpt is None:
            return choose_checkpoint(flag, ckpt_dir, stem, global_rank, ours)
        if global_rank == 0:
            self.fetch_newer(Path(ckpt_dir), stem)
            return choose_checkpoint(flag, ckpt_dir, stem, global_rank, ours)
        local = choose_checkpoint(flag, ckpt_dir, stem, global_rank, ours)
        try:
            found = local is None and bool(self.newest(stem))
        except CheckpointError:
            found = False  # rank 0 meets the same and stops (or has a local checkpoint: then the ranks disagree, and say so)
        if found:
            return self.ckpt.url  # rank 0 downloads it; this rank loads rank 0's file (agree_on_checkpoint)
        return local
