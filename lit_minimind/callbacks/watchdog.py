"""Hangs end themselves: a watchdog thread in every rank exits the process when no optimizer step has
completed for too long, so that ``torchrun --max-restarts`` or a SLURM retry restarts the job and
``--ckpt_path last`` resumes it exactly.

Lightning has no hang detection of its own beyond the process group's timeout (30 min by default, and
none at all for a DataLoader worker or a filesystem that stops answering). :class:`Watchdog`'s hooks
stamp a monotonic clock and name the phase the loop is in; a daemon thread compares the time since the
last progress with the phase's bound and, past it, writes every thread's stack
(``faulthandler.dump_traceback(all_threads=True)``), one line naming the rank, the phase and the
seconds waited, and ends the process with :data:`HANG_EXIT` (``os._exit``: immediate, also while the
main thread is blocked in a C call that released the GIL). A C call that holds the GIL starves every
Python thread: for it, faulthandler's own C timer (``dump_traceback_later(exit=True)``) is armed a
little after the largest bound, and ends the process with exit 1 after dumping the stacks.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import statistics
import sys
import threading
import time
from collections import deque
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

import lightning as L
from lightning.pytorch.callbacks import Callback

from lit_minimind.callbacks.preemption import STOP
from lit_minimind.resume.internals import launched_ranks

HANG_EXIT = 6  # exit code of a rank whose watchdog saw no optimizer step within its bound (a hang)
STEP_WINDOW = 100  # completed optimizer steps the median step time is taken over (a rolling window)
BACKSTOP_GRACE = 10.0  # seconds after the largest bound at which faulthandler's C timer fires (GIL held)

# the main thread's stack refines the phase the hooks name: a save waits for the previous write before
# any save hook runs, and a collective or a DataLoader shows where the loop actually blocks
_SAVE_FRAMES = {  # (path suffix, function names) of the save path; a function of Lightning's by name only
    "lit_minimind/resume/io.py": {"save_checkpoint", "wait", "submit"},
    # (on_train_end: every rank waits there for rank 0's last write; _raise_if_failed: for its outcome)
    "lit_minimind/callbacks/resume.py": {"save", "_save_best", "_begin_save", "_wait_for_writes", "_raise_if_failed",
                                         "on_train_end"},
    "lightning/pytorch/trainer/trainer.py": {"save_checkpoint"},
}


def stack_phase(frame: FrameType | None) -> str | None:
    """The phase a thread's stack shows: ``save`` when any frame is in a checkpoint save or the wait for
    one (a peer waiting in a collective for rank 0's save is saving too); else, innermost first,
    ``optimizer/collective`` in torch.distributed, ``data`` in a DataLoader; else ``None``."""
    frames: list[FrameType] = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    for f in frames:
        path = f.f_code.co_filename.replace(os.sep, "/")
        if any(path.endswith(suffix) and f.f_code.co_name in names for suffix, names in _SAVE_FRAMES.items()):
            return "save"
    for f in frames:  # innermost first
        path = f.f_code.co_filename.replace(os.sep, "/")
        if "/torch/distributed/" in path:
            return "optimizer/collective"
        if "/torch/utils/data/" in path:
            return "data"
    return None


class Watchdog(Callback):
    """Ends a rank that has completed no optimizer step for too long (exit 6), and the ranks it launched.

    Bounds, in seconds since the last progress (a completed optimizer step; validation's start and each
    of its batches; an epoch's start):

    * a step: ``max(factor * median step time, floor)``, the median over the run's own last
      completed optimizer steps (steps with a save, a validation or an epoch start in them excluded);
      ``floor`` until there is one;
    * start-up and the first optimizer step of each epoch (DataLoader workers start, a restore, a
      ``torch.compile``), and validation's first batch: ``startup``;
    * a save (the loop's snapshot, or its wait for the previous background write), and the end of
      training (it waits for the last write): ``save``.

    The phase the line names is the last hook seen, corrected by the main thread's stack (:func:`stack_phase`).
    Off while a stop signal is being handled (the stop path finishes the step and saves; the scheduler's
    own kill bounds it), after an exception, and from the fit's teardown on.

    Args:
        enabled: run the watchdog.
        factor: a step may take this many times the run's median step time (and at least ``floor``).
        floor: the least time in seconds an optimizer step is allowed, whatever the median.
        startup: seconds allowed for start-up and each epoch's first optimizer step (and validation's first batch).
        save: seconds a save may block the loop (its snapshot, or its wait for the previous write).
        stacks: write the stacks to this file instead of stderr (``{rank}`` in it is replaced by the global
            rank; without it, under DDP, ``.rank{N}`` is appended); the line names it.
    """

    def __init__(self, enabled: bool = True, factor: float = 20.0, floor: float = 300.0, startup: float = 900.0,
                 save: float = 900.0, stacks: str | None = None) -> None:
        for name, value in (("factor", factor), ("floor", floor), ("startup", startup), ("save", save)):
            if not value > 0:  # (also NaN)
                raise ValueError(f"--watchdog.{name} must be > 0{'' if name == 'factor' else ' seconds'}, got {value}")
        self.enabled, self.factor, self.floor, self.startup, self.save = enabled, factor, floor, startup, save
        self.stacks = stacks
        self.phase = "start-up"
        self.hook = "setup"
        self.rank, self.world_size = 0, 1
        self._lock = threading.Lock()
        self._last = time.monotonic()  # the last progress
        self._step_started: float | None = None  # the last completed optimizer step (None: none since a pause)
        self._steps: deque[float] = deque(maxlen=STEP_WINDOW)
        self._step_bound = floor  # max(factor * median step, floor); the floor until a step was timed
        self._clean = False  # the step in progress has no save / validation / epoch start in it
        self._slow = True  # start-up, an epoch's first step, validation's first batch: the startup bound
        self._global_step = 0
        self._armed = False
        self._main: int | None = None
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None
        self._backstop_at: float | None = None
        self._backstop_lock = threading.Lock()  # the thread arms it, the loop's end cancels it: never after
        self._trainer: Any = None

    # ------------------------------------------------------------------ bounds
    def step_bound(self) -> float:
        return self._step_bound

    def bound(self, phase: str) -> float:
        if phase in ("save", "end"):  # end: training's end waits for the last save's write
            return self.save
        return self.startup if self._slow else self.step_bound()

    # ------------------------------------------------------------------ state changes (hooks)
    def _progress(self, phase: str, hook: str, *, slow: bool | None = None, clean: bool | None = None) -> None:
        with self._lock:
            self._last = last = time.monotonic()
            self.phase, self.hook = phase, hook
            if slow is not None:
                self._slow = slow
            if clean is not None:
                self._clean = clean
        self._arm_backstop(last)  # here too: the watching thread may never run again (the GIL held)

    def _enter(self, phase: str, hook: str) -> None:
        self.phase, self.hook = phase, hook

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if not self.enabled or stage != "fit":
            return
        self.rank, self.world_size = trainer.global_rank, trainer.world_size
        self._trainer = trainer  # its launcher's children (the other ranks of this node) end with this rank
        self._main = threading.get_ident()
        self._global_step = trainer.global_step
        self._step_started, self._steps, self._step_bound = None, deque(maxlen=STEP_WINDOW), self.floor
        self._armed = True
        self._progress("start-up", "setup", slow=True, clean=False)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(self._stop,), name="watchdog", daemon=True)
        self._thread.start()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._global_step = trainer.global_step  # restored by now: the next change is a completed step

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._step_started = None  # the first step of an epoch starts DataLoader workers: not a step time
        self._progress("data", "on_train_epoch_start", slow=True, clean=False)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self._enter("forward/backward", "on_train_batch_start")

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: Any) -> None:
        self._enter("forward/backward", "on_before_backward")

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._enter("forward/backward", "on_after_backward")

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self._enter("optimizer/collective", "on_before_optimizer_step")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step == self._global_step:  # inside an accumulation window: no step completed
            self._enter("data", "on_train_batch_end")
            return
        self._global_step = trainer.global_step
        now = time.monotonic()
        with self._lock:
            if self._step_started is not None and self._clean:
                self._steps.append(now - self._step_started)
                self._step_bound = max(self.factor * statistics.median(self._steps), self.floor)
        self._step_started = now
        self._progress("data", "on_train_batch_end", slow=False, clean=True)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        with self._lock:
            self.phase, self.hook, self._clean = "save", "on_save_checkpoint", False

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._progress("validation", "on_validation_start", slow=True, clean=False)

    def on_validation_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int,
                                  dataloader_idx: int = 0) -> None:
        self._enter("validation", "on_validation_batch_start")

    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        self._progress("validation", "on_validation_batch_end", slow=False)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # back to training: the first step after it may be an epoch's first (on_train_epoch_start says so)
        self._progress("data", "on_validation_end", slow=trainer.sanity_checking or self._step_started is None)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # still armed: the end waits for the last write (ResumeCallback.on_train_end), bounded as a save;
        # disarmed at teardown (before ResumeCallback's: a remote's upload wait has its own timeout)
        self._progress("end", "on_train_end", slow=False)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._disarm()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._disarm()
        if self._stop is not None:
            self._stop.set()
        self._thread = self._stop = None

    def _disarm(self) -> None:
        with self._backstop_lock:
            self._armed = False
        self._cancel_backstop()

    # ------------------------------------------------------------------ the watching thread
    def _watch(self, stop: threading.Event) -> None:
        tick = max(0.05, min(1.0, self.floor / 5, self.startup / 5, self.save / 5))
        while not stop.wait(tick):
            if not self._armed:  # training ended or raised: nothing to watch any more
                self._cancel_backstop()
                return
            if STOP.requested:  # a stop signal: its own path (and the scheduler's kill) ends the process
                self._cancel_backstop()
                continue
            with self._lock:
                last, phase = self._last, self.phase
            waited = time.monotonic() - last
            self._arm_backstop(last)
            if waited <= min(self.bound(phase), self.bound("save"), self.bound("step")):
                continue  # no phase's bound is reached: the stack need not be looked at
            frame = sys._current_frames().get(self._main) if self._main is not None else None
            seen = stack_phase(frame)
            kind = "end" if phase == "end" else seen or phase  # what bounds it
            bound = self.bound(kind)
            if waited > bound and self._armed and not STOP.requested:
                self._fire(seen or phase, waited, bound, kind)

    def _arm_backstop(self, last: float) -> None:
        """faulthandler's C timer a little after the largest bound: it fires without the GIL. Cheap when
        the deadline moved little (each re-arm starts a C thread): called at every progress."""
        at = last + max(self.startup, self.save, self._step_bound) + BACKSTOP_GRACE
        with self._backstop_lock:
            if not self._armed or STOP.requested:
                return
            if self._backstop_at is not None and abs(at - self._backstop_at) < BACKSTOP_GRACE / 2:
                return
            try:
                faulthandler.dump_traceback_later(max(at - time.monotonic(), 1.0), exit=True, file=sys.stderr)
                self._backstop_at = at
            except (AttributeError, ValueError, OSError, RuntimeError):  # stderr without a file descriptor
                self._backstop_at = float("inf")

    def _cancel_backstop(self) -> None:
        with self._backstop_lock:
            if self._backstop_at is not None:
                faulthandler.cancel_dump_traceback_later()
                self._backstop_at = None

    def _stacks_file(self) -> Path | None:
        if not self.stacks:
            return None
        name = self.stacks.replace("{rank}", str(self.rank))
        if name == self.stacks and self.world_size > 1:
            name = f"{name}.rank{self.rank}"
        return Path(name)

    def _fire(self, phase: str, waited: float, bound: float, kind: str) -> None:
        """Every thread's stack, one line, and exit :data:`HANG_EXIT` at once (this thread is not the
        stuck one; ``os._exit`` ends the process whatever the main thread is blocked in)."""
        self._cancel_backstop()
        with self._lock:
            median = statistics.median(self._steps) if self._steps else None
        if kind in ("save", "end"):
            why = f"--watchdog.save {self.save:g} s"
        elif self._slow:
            why = f"--watchdog.startup {self.startup:g} s (start-up, an epoch's first step, validation's first batch)"
        elif median is not None:
            why = f"max({self.factor:g} x median step {median:.3f} s, floor {self.floor:g} s) = {bound:.1f} s"
        else:
            why = f"--watchdog.floor {self.floor:g} s"
        target = self._stacks_file()
        try:
            if target is None:  # a line of its own first (through sys.stderr: it starts a new line)
                print(f"[rank {self.rank}] watchdog: every thread's stack, most recent call first:",
                      file=sys.stderr, flush=True)
                sys.stdout.flush()
                _dump(sys.stderr)
                where = "above"
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                with open(target, "w") as f:
                    _dump(f)
                where = f"in {target}"
        except (OSError, ValueError) as err:
            where = f"not written ({err})"
        line = (f"[rank {self.rank}] error: hang: no optimizer step completed for {waited:.1f} s in phase {phase} "
                f"(last hook {self.hook}, after optimizer step {self._global_step}), past {why}; every thread's stack "
                f"{where}. Exiting with code {HANG_EXIT}: restart with the same command plus --ckpt_path last")
        try:
            print(line, file=sys.stderr, flush=True)
        except (OSError, ValueError):
            pass
        _kill_workers()
        self._end_launched_ranks()
        os._exit(HANG_EXIT)

    def _end_launched_ranks(self) -> None:
        """The other ranks this process launched (Lightning's launcher: rank 0 of a node) would outlive it, a frozen
        one stopped for good with its memory (a GPU's too): SIGKILL, the one signal a frozen process cannot miss."""
        try:
            launcher, procs = launched_ranks(self._trainer) if self._trainer is not None else (None, [])
            if procs:
                launcher.kill(signal.SIGKILL)
                print(f"[rank {self.rank}] watchdog: ended the {len(procs)} other rank process(es) this one launched "
                      f"(pid {', '.join(str(p.pid) for p in procs)}) with SIGKILL", file=sys.stderr, flush=True)
        except (OSError, ValueError, AttributeError):
            pass


def _kill_workers() -> None:
    """SIGKILL this process's multiprocessing children (DataLoader workers): one stuck in a read would
    outlive it, holding its memory and the pipes of its output. Other DDP ranks are not among them."""
    import multiprocessing

    try:
        children = multiprocessing.active_children()
    except (OSError, ValueError, AssertionError):
        return
    for child in children:
        try:
            child.kill()
        except (OSError, ValueError, AttributeError):
            pass


def _dump(file: TextIO) -> None:
    try:
        faulthandler.dump_traceback(file, all_threads=True)
    except (AttributeError, ValueError, OSError):  # no file descriptor (a captured stream): Python's own format
        import traceback

        for ident, frame in sys._current_frames().items():
            file.write(f"Thread {ident:#x} (most recent call first):\n")
            file.write("".join(reversed(traceback.format_stack(frame))))
    file.flush()
