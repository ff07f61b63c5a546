"""The background uploader: mirrors each committed local save to object storage, never stalling training.

One daemon thread; only the newest pending save is kept (a newer save replaces one not yet started).
A failure of any kind (endpoint down, 5xx, timeout, a torn or mismatching upload) is retried with
exponential backoff while training goes on; the remote catches up with the newest save when it
answers again. :meth:`Uploader.finish` waits, bounded, for the last one at the end of a run.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Upload:
    """One save to mirror: ``steps`` run in order (each idempotent: a retry skips what is committed);
    ``label`` names the save (epoch, step, global step); ``close`` releases its open files."""

    label: dict[str, Any]
    steps: list[Callable[[], None]]
    close: Callable[[], None] = lambda: None
    committed: Callable[[], None] = lambda: None  # after the commit record (the first step)
    extra: dict[str, Any] = field(default_factory=dict)


def describe(label: dict[str, Any] | None) -> str:
    if not label:
        return "no checkpoint"
    return f"epoch {int(label.get('epoch', 0)) + 1} step {label.get('step')} (global step {label.get('global_step')})"


class Uploader:
    """Runs :class:`Upload` jobs on one background thread, newest first, with retries and backoff."""

    def __init__(self, where: str, backoff: tuple[float, float] = (0.5, 8.0), out: Any = None) -> None:
        self.where = where
        self.backoff = backoff
        self.out = out
        self.holds: dict[str, Any] | None = None  # the newest save committed on the remote (by this process)
        self.latest: dict[str, Any] | None = None  # the newest save offered
        self._pending: Upload | None = None
        self._busy = False
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def _say(self, line: str) -> None:
        print(line, file=self.out or sys.stdout, flush=True)

    def offer(self, job: Upload) -> None:
        """Queue ``job``, replacing a pending one that has not started."""
        with self._cond:
            if self._pending is not None:
                self._pending.close()
            self._pending, self.latest = job, job.label
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="checkpoint-uploader", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def _run(self) -> None:
        failures = 0
        while True:
            with self._cond:
                while self._pending is None:
                    self._cond.wait()
                job, self._pending, self._busy = self._pending, None, True
            try:
                job.steps[0]()
                self.holds = job.label
                job.committed()
                for step in job.steps[1:]:
                    step()
            except Exception as err:  # noqa: BLE001 - any failure of the remote: retried, training goes on
                failures += 1
                if failures == 1:
                    self._say(f"remote: upload of {describe(job.label)} to {self.where} failed "
                              f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); "
                              "retrying with backoff, training goes on")
                delay = min(self.backoff[0] * 2 ** (failures - 1), self.backoff[1])
                with self._cond:
                    if self._pending is None:
                        self._pending = job  # retry it, unless a newer save replaced it meanwhile
                    else:
                        job.close()
                    self._busy = False
                    self._cond.notify_all()
                    self._cond.wait(delay)  # a backoff; an offer or finish wakes it early only to re-check
                continue
            if failures:
                self._say(f"remote: {self.where} answers again")
            failures = 0
            self._say(f"remote: {describe(job.label)} committed to {self.where}")
            job.close()
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def finish(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for every offered save; True when the remote holds the newest."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._pending is not None or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            return self.latest is None or self.holds == self.latest
