"""Preemption signals as a request to stop cleanly (hand-written: Lightning only handles SIGTERM,
by raising at the end of the current batch, mid accumulation window, and never saves first); on
clusters, SIGUSR1 under SLURM then requeues the job, and a lost DDP peer ends the run with one line."""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
from types import FrameType
from typing import Any

import torch

STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1")


class StopRequest:
    """Records the first SIGTERM / SIGINT / SIGUSR1; a second SIGINT aborts at once (exit 130).

    One per process (:data:`STOP`): ``python -m lit_minimind.fit`` handles the stop signals from its first
    line (:func:`lit_minimind.fit.record_stop_signal`, before the seconds of imports) and installs this
    as soon as it is imported, so a signal during start-up is recorded too;
    :class:`lit_minimind.callbacks.ResumeCallback` installs it again
    when training starts, replacing the SIGTERM handler Lightning registers just before.

    A handler only records the signal (and prints one line); ranks agree at the next optimizer step.
    Lightning's own SIGTERM handler, active from the end of restore until training starts, broadcasts
    a tensor inside the handler under DDP (Lightning PR #20825): a SIGTERM reaching one rank there makes
    its collectives mismatch the others' and hangs the job. :meth:`hold_sigterm` keeps SIGTERM away
    from every Python handler over that stretch.
    """

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._previous: dict[int, Any] = {}
        self._holding = False
        self._forks_release = False

    @property
    def requested(self) -> bool:
        """A stop signal was received (or, while SIGTERM is held, one is pending)."""
        return self.signal_name is not None or (self._holding and signal.SIGTERM in signal.sigpending())

    def install(self) -> None:
        """Handle the stop signals (main thread only; idempotent). Takes over from the start-up handler
        of ``python -m lit_minimind.fit`` (:func:`lit_minimind.fit.record_stop_signal`): a signal it
        recorded during the imports counts as requested here (no line: the stop prints its own)."""
        if threading.current_thread() is not threading.main_thread():
            return
        early: list[str] = []
        for name in STOP_SIGNALS:
            signum = getattr(signal, name, None)
            if signum is None:
                continue
            previous = signal.signal(signum, self._handle)
            received = getattr(previous, "stop_signals_received", None)
            if received is not None:  # the start-up handler: restore what it replaced, not it
                early = received
                previous = previous.replaced.get(signum, signal.SIG_DFL)
            if previous is not self._handle:  # a bound method compares equal to itself
                self._previous.setdefault(signum, previous)
        if early and self.signal_name is None:  # read once every handler is ours: none is lost in between
            self.signal_name = early[0]

    def uninstall(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()
        self.release_sigterm()

    def hold_sigterm(self) -> None:
        """Until :meth:`release_sigterm`: SIGTERM blocked in this thread and every thread started from it,
        so it stays pending (:attr:`requested` sees it) and reaches our handler, in the main thread, when
        released. Call it first thing in the process (main thread), before any other thread exists.

        No thread waits for it meanwhile: one would record it only once it got the GIL, and the main thread
        could ask :attr:`requested` first and train a window it was told to skip."""
        if threading.current_thread() is not threading.main_thread() or self._holding:
            return
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        self._holding = True
        if not self._forks_release:
            self._forks_release = True
            os.register_at_fork(after_in_child=self.release_sigterm)  # a forked child (a worker) owns its signals

    def release_sigterm(self) -> None:
        """SIGTERM reaches the Python handler again (call it once ours has replaced Lightning's); a pending
        one runs the handler before this returns (``pthread_sigmask`` checks for signals)."""
        if self._holding and threading.current_thread() is threading.main_thread():
            self._holding = False
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})

    def agreed(self, trainer: Any) -> bool:
        """True when a stop was requested on any rank (a collective under DDP: call it on every rank)."""
        if trainer.world_size == 1:
            return self.requested
        flag = torch.tensor([1.0 if self.requested else 0.0], device=trainer.strategy.root_device)
        return bool(trainer.strategy.reduce(flag, reduce_op="max").item() > 0)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signal_name is not None and name == "SIGINT":
            print("second SIGINT: aborting now, without saving", flush=True)
            os._exit(130)
        if self.signal_name is None:
            self.signal_name = name
            print(f"{name} received: finishing the current optimizer step, then saving and stopping "
                  "(press Ctrl-C again to abort at once)", flush=True)


STOP = StopRequest()


# ---------------------------------------------------------------------------------------------------
# Clusters: SIGUSR1 under SLURM requeues the job; a lost DDP peer ends the run with one line of advice.

REQUEUE_SIGNAL = "SIGUSR1"  # SLURM's --signal=USR1@<seconds>: the job is about to reach its time limit
LOST_PEER_EXIT = 3  # exit code of a rank whose DDP peer died or stopped answering
REQUEUE_FAILED_EXIT = 4  # the checkpoint is saved but `scontrol requeue` failed: resubmit the job


def under_slurm() -> bool:
    """A SLURM job as Lightning's ``SLURMEnvironment`` sees one: ``SLURM_NTASKS`` set (an ``srun``/``sbatch``
    task) and a job name other than ``bash``/``interactive`` (an interactive allocation is not managed)."""
    return ("SLURM_JOB_ID" in os.environ and "SLURM_NTASKS" in os.environ
            and os.environ.get("SLURM_JOB_NAME") not in ("bash", "interactive"))


def slurm_job_id() -> str:
    """``SLURM_JOB_ID``, or ``{array job}_{task}`` for an array task (what ``scontrol requeue`` takes)."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    if array_job is not None and "SLURM_ARRAY_TASK_ID" in os.environ:
        return f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    return os.environ["SLURM_JOB_ID"]


def stops_at_once(signal_name: str | None) -> bool:
    """Whether a stop signal received while ``python -m lit_minimind.fit`` was importing may end the process
    at once, before anything is parsed or built (:func:`lit_minimind.fit.main`). Not in a job of processes
    launched together (torchrun, the children of Lightning's DDP launcher, ``srun`` tasks, a multi-node
    launch by hand): a peer that did not get the signal would wait for this one; nor SIGUSR1 under SLURM,
    whose requeue (:func:`requeue_if_preempted`) needs the trainer. Those stop where the ranks agree,
    before the first batch (``ResumeCallback.on_train_start``), as a signal later in start-up does."""
    if signal_name is None:
        return False
    peers = any(name in os.environ for name in ("LOCAL_RANK", "NODE_RANK", "MASTER_ADDR", "TORCHELASTIC_RUN_ID"))
    for name in ("WORLD_SIZE", "SLURM_NTASKS"):
        try:
            peers = peers or int(os.environ.get(name, "1")) > 1
        except ValueError:
            peers = True
    return not peers and not (signal_name == REQUEUE_SIGNAL and under_slurm())


def cluster_plugins(plugins: list[Any], strategy: Any = None) -> list[Any]:
    """What ``python -m lit_minimind.fit`` adds to ``Trainer(plugins=...)``: under SLURM (and not under
    torchrun, which Lightning prefers), ``SLURMEnvironment(auto_requeue=False)``, so that Lightning neither
    registers its SIGUSR1 handler (an ``hpc_ckpt_*.ckpt`` mid accumulation window, then a requeue before
    our checkpoint is on disk) nor resumes from such a file: SIGUSR1 is :data:`STOP`'s, and
    :func:`requeue_if_preempted` requeues once the checkpoint is committed. Nothing when the user chose a
    cluster environment (``--trainer.plugins``, or the strategy's own)."""
    from lightning.fabric.plugins.environments import ClusterEnvironment, SLURMEnvironment, TorchElasticEnvironment

    if not under_slurm() or TorchElasticEnvironment.detect():
        return []
    if any(isinstance(p, ClusterEnvironment) for p in plugins) or getattr(strategy, "cluster_environment", None):
        return []
    return [SLURMEnvironment(auto_requeue=False)]


def requeue_if_preempted(trainer: Any, stopped_by: str | None, ckpt_path_flag: str | None = None) -> int:
    """After ``trainer.fit`` returned (every checkpoint write finished and verified: a failed one raised
    before this), under SLURM, when training was stopped by SIGUSR1 on any rank: global rank 0 runs
    ``scontrol requeue <job id>``. Returns the exit code: 0, or :data:`REQUEUE_FAILED_EXIT`.

    Call it on every rank (one small all-reduce under DDP, to agree whether SIGUSR1 was the reason)."""
    if stopped_by is None or not under_slurm():  # the same on every rank: the collective below is safe
        return 0
    io = trainer.strategy.checkpoint_io
    if getattr(io, "wait", None) is not None:
        io.wait()  # already done by ResumeCallback at the end of training; the requeue must come after it
    if getattr(io, "failed", False):  # cannot happen (a failed write raised), but never requeue onto it
        print("error: SLURM: the last checkpoint write failed; job not requeued", file=sys.stderr, flush=True)
        return REQUEUE_FAILED_EXIT
    usr1 = STOP.signal_name == REQUEUE_SIGNAL
    if trainer.world_size > 1:
        flag = torch.tensor([float(usr1)], device=trainer.strategy.root_device)
        usr1 = bool(trainer.strategy.reduce(flag, reduce_op="max").item() > 0)
    if not usr1 or not trainer.is_global_zero:
        return 0
    job_id = slurm_job_id()
    epochs_done = trainer.max_epochs is not None and 0 <= trainer.max_epochs <= trainer.current_epoch
    if epochs_done or 0 < trainer.max_steps <= trainer.global_step:
        print(f"SLURM: {REQUEUE_SIGNAL} came as training finished; job {job_id} not requeued", flush=True)
        return 0
    if ckpt_path_flag != "last":
        print("SLURM: warning: the requeued job runs the same command, which lacks --ckpt_path last: "
              "it will start over instead of resuming", file=sys.stderr, flush=True)
    import subprocess

    try:
        result = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=120)
        code, detail = result.returncode, (result.stderr or result.stdout).strip()
    except (OSError, subprocess.SubprocessError) as err:  # scontrol not on PATH, slurmctld not answering
        code, detail = -1, str(err)
    if code != 0:
        print(f"error: SLURM: scontrol requeue {job_id} failed ({detail or f'exit {code}'}): the checkpoint "
              "is saved; resubmit the job (it resumes with --ckpt_path last)", file=sys.stderr, flush=True)
        return REQUEUE_FAILED_EXIT
    print(f"SLURM: checkpoint committed; requeued job {job_id} (scontrol requeue {job_id}): "
          "it resumes from the checkpoint with --ckpt_path last", flush=True)
    return 0


_LOST_PEER = re.compile(r"\bgloo\b|\bnccl\b|connection (closed|reset|refused)|by peer|broken pipe|timed out|"
                        r"\btimeout\b|\bTCPStore\b|heartbeat", re.IGNORECASE)


def lost_peer_advice(error: BaseException) -> str | None:
    """One ``error:`` line when ``error``, raised in a DDP job, says a peer died or stopped answering
    (gloo raises a connection error at once when a peer's process dies, and a timeout after the process
    group's ``timeout`` when a peer hangs or its machine is gone); ``None`` for any other error."""
    import torch.distributed as dist

    if not dist.is_available():
        return None
    if dist.is_initialized():
        world_size, rank = dist.get_world_size(), dist.get_rank()
    else:  # the process group could not form (a node never came, or died while it formed)
        world_size, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    dist_error = isinstance(error, getattr(dist, "DistError", ()))  # DistBackendError, DistStoreError, ...
    peer_error = dist.is_initialized() and isinstance(error, RuntimeError) and _LOST_PEER.search(str(error))
    if world_size <= 1 or not (dist_error or peer_error):
        return None
    first = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
    first = re.sub(r"^\[[^\]]*\]\s*", "", first).split(". ")[0].rstrip(".")  # no source location, one sentence
    return (f"[rank {rank}] error: lost contact with another process of this {world_size}-process DDP job "
            f"({first[:200]}). Training stopped; work since the last checkpoint is lost. Restart every node "
            "with the same command plus --ckpt_path last")
