"""The background uploader: mirrors each committed local save to object storage, never stalling training.

The uploads run in a child process (``python -m lit_minimind.resume.upload``, niced), so neither its
CPU nor Python's GIL competes with the training loop; the parent sends it jobs (JSON lines on its
stdin) and a reader thread, blocked on the child's event pipe, prints its lines and records what the
remote holds. A job's files are hard links made at offer time (``{dir}/.upload/``): a later save or
the local retention cannot change what is uploaded. In the child only the newest pending job is
kept (a newer save replaces one not yet started); a failure of any kind (endpoint down, 5xx, timeout,
a torn or mismatching upload) is retried with exponential backoff while training goes on, and the
remote catches up with the newest save when it answers again. :meth:`Uploader.finish` waits, bounded,
for the last one at the end of a run. The child ends with its parent (its stdin closes): a kill of the
run during an upload leaves the remote at its previous commit.

Job steps (data, run by :func:`run_step`): ``["upload", url, local_path, name, manifest]``,
``["copy", url, source_name, name, manifest]``, ``["prune", url, pattern, run_id, keep_last]``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lit_minimind.checkpoint.atomic import link_or_copy

UPLOAD_DIR = ".upload"  # beside the files: the hard links a pending upload reads
BACKOFF = (0.5, 8.0)  # seconds: first retry, cap (doubling in between)


def describe(label: dict[str, Any] | None) -> str:
    if not label:
        return "no checkpoint"
    return f"epoch {int(label.get('epoch') or 0) + 1} step {label.get('step')} (global step {label.get('global_step')})"


def link_for_upload(path: Path, tag: str) -> Path:
    """A hard link to ``path`` in ``{dir}/.upload/`` (a copy where there are no hard links)."""
    target = path.parent / UPLOAD_DIR / f"{tag}-{path.name}"
    target.parent.mkdir(exist_ok=True)
    target.unlink(missing_ok=True)
    link_or_copy(path, target)
    return target


class Uploader:
    """The parent side: sends jobs to the upload process, knows what the remote holds."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.holds: dict[str, Any] | None = None  # the newest save committed on the remote
        self.latest: dict[str, Any] | None = None  # the newest save offered
        self._done: dict[str, Any] | None = None  # the newest job the child finished (every step)
        self._count = 0
        self._cond = threading.Condition(threading.RLock())  # start() inside offer()
        self._proc: subprocess.Popen | None = None
        self._proc_gone = False

    def start(self) -> None:
        """Start the upload process (if not running): early, so its start-up overlaps the trainer's."""
        with self._cond:
            if self._proc is None or self._proc.poll() is not None:
                self._proc_gone = False
                self._proc = self._start()

    def _start(self) -> subprocess.Popen:
        # the same interpreter and environment: it imports lit_minimind as this process did (installed, or the cwd's)
        proc = subprocess.Popen([sys.executable, "-m", "lit_minimind.resume.upload"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, bufsize=1)
        threading.Thread(target=self._read, args=(proc,), name="checkpoint-upload-events", daemon=True).start()
        return proc

    def _read(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            with self._cond:
                if "say" in event:
                    print(event["say"], flush=True)
                if "committed" in event:
                    self.holds = event["committed"]
                if "done" in event:
                    self._done = event["done"]
                self._cond.notify_all()
        with self._cond:
            if proc is self._proc:
                self._proc_gone = True
            self._cond.notify_all()

    def offer(self, label: dict[str, Any], steps: list[list[Any]], links: list[str], commit: int = 0) -> None:
        """Queue a save's upload (``steps``, reading ``links``, removed once done or replaced); step
        ``commit`` is the commit record (the checkpoint's manifest object)."""
        with self._cond:
            self.start()  # (first save, or the process died)
            self._count += 1
            self.latest = {**label, "job": self._count}
            assert self._proc.stdin is not None
            try:
                self._proc.stdin.write(json.dumps({"label": self.latest, "steps": steps, "links": links,
                                                    "commit": commit}) + "\n")
                self._proc.stdin.flush()
            except (OSError, ValueError) as err:  # never a reason to stop training: the next save restarts it
                print(f"remote: the upload process is gone ({err}); the next save starts a new one", flush=True)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The upload process stands still (SIGSTOP ... SIGCONT) while the training loop takes a save's
        snapshot: its copies do not compete for the memory bandwidth and CPU the snapshot needs. (Should
        this process die meanwhile, the kernel continues and hangs up the orphaned process: it exits.)"""
        proc = self._proc
        if proc is None or proc.poll() is not None or not hasattr(signal, "SIGSTOP"):
            yield
            return
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(proc.pid, signal.SIGCONT)

    def finish(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the newest offered save; True when the remote holds it. The
        upload process is then stopped (closing its stdin; killed if it is still uploading)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._proc is not None and self._done != self.latest and not self._proc_gone:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            ok = self.latest is None or (self._done == self.latest and self.holds == self.latest)
        if self._proc is not None:
            with contextlib.suppress(OSError):
                self._proc.stdin.close()  # type: ignore[union-attr]
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        return ok

    def summary_label(self, which: str) -> dict[str, Any] | None:
        label = self.holds if which == "holds" else self.latest
        return {k: v for k, v in label.items() if k != "job"} if label else None


# ---------------------------------------------------------------------------------------- the upload process
_remotes: dict[str, Any] = {}


def run_step(step: list[Any]) -> None:
    from lit_minimind.checkpoint.atomic import retain
    from lit_minimind.checkpoint.remote import RemoteDir

    kind, url, *args = step
    remote = _remotes.get(url) or _remotes.setdefault(url, RemoteDir(url))
    if kind == "upload":
        local, name, manifest = args
        remote.commit(name, Path(local), manifest)
    elif kind == "copy":
        remote.copy(*args)
    elif kind == "prune":
        retain(remote, *args)
    else:
        raise ValueError(f"unknown upload step {kind}")


class _Worker:
    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.pending: dict[str, Any] | None = None
        self.out = sys.stdout
        sys.stdout = sys.stderr  # nothing but events on the event pipe

    def emit(self, **event: Any) -> None:
        self.out.write(json.dumps(event) + "\n")
        self.out.flush()

    @staticmethod
    def clean(job: dict[str, Any]) -> None:
        for link in job["links"]:
            with contextlib.suppress(OSError):
                os.unlink(link)

    def read_jobs(self) -> None:
        for line in sys.stdin:
            job = json.loads(line)
            with self.cond:
                if self.pending is not None:
                    self.clean(self.pending)  # replaced by a newer save before it started
                self.pending = job
                self.cond.notify_all()
        os._exit(0)  # the run ended (or was killed): stop at once, mid-upload included

    def run(self) -> None:
        threading.Thread(target=self.read_jobs, daemon=True).start()
        failures = 0
        while True:
            with self.cond:
                while self.pending is None:
                    self.cond.wait()
                job, self.pending = self.pending, None
            label, where = job["label"], job["steps"][0][1] if job["steps"] else ""
            try:
                for i, step in enumerate(job["steps"]):
                    run_step(step)
                    if i == job.get("commit", 0):
                        self.emit(committed=label)
            except Exception as err:  # noqa: BLE001 - any failure of the remote: retried, training goes on
                failures += 1
                if failures == 1:
                    reason = str(err).splitlines()[0] if str(err) else ""
                    self.emit(say=f"remote: upload of {describe(label)} to {where} failed ({type(err).__name__}: "
                                  f"{reason}); retrying with backoff, training goes on")
                delay = min(BACKOFF[0] * 2 ** (failures - 1), BACKOFF[1])
                with self.cond:
                    if self.pending is None:
                        self.pending = job  # retry it, unless a newer save replaced it meanwhile
                    else:
                        self.clean(job)
                    self.cond.wait(delay)  # the backoff (a newer job ends it early)
                continue
            if failures:
                self.emit(say=f"remote: {where} answers again")
            failures = 0
            self.clean(job)
            self.emit(say=f"remote: {describe(label)} committed to {where}", done=label)


if __name__ == "__main__":
    with contextlib.suppress(OSError, AttributeError):
        os.nice(10)  # training first
    _Worker().run()
