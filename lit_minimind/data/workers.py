"""DataLoader worker processes: never more than the cores this process may use, and never acting on a stop
signal (the main process owns the stop)."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from functools import partial

STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1")
_said: set[tuple[int, int]] = set()  # (asked, cores) whose capping line this process printed


def usable_cores() -> int:
    """The CPU cores this process may run on, as torch's DataLoader counts them for its "worker processes
    in total" warning: ``os.sched_getaffinity`` (a cpuset, ``taskset``, SLURM's binding), else ``os.cpu_count``."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def capped_workers(asked: int, rank: int = 0) -> int:
    """``asked`` DataLoader workers (``--data.num_workers``), at most :func:`usable_cores`: more workers than
    cores only wait for each other, and torch warns for each loader. When capped, global rank 0 (``rank``) says
    so in one line on stderr, once per process. The batches are the same: their order is the sampler's, in this
    process. RL prompts are never capped: their draws happen in MiniMind's worker layout (:mod:`lit_minimind.data.rlaif`),
    and the same draws need the same workers (the datamodule does not call this for them)."""
    cores = usable_cores()
    if asked <= cores:
        return asked
    if rank == 0 and (asked, cores) not in _said:
        _said.add((asked, cores))
        print(f"data: --data.num_workers {asked} capped at {cores}: this process may use {cores} CPU "
              f"core{'s' if cores > 1 else ''}", file=sys.stderr, flush=True)
    return cores


def ignore_stop_signals(worker_id: int, then: Callable[[int], None] | None = None) -> None:
    """A ``worker_init_fn``: SIGTERM, SIGINT and SIGUSR1 are ignored in the worker (SLURM, ``scancel`` and
    Ctrl-C signal the whole process group; the main process saves and stops, and its workers exit with
    it: torch's worker loop ends when its parent is gone). Then ``then(worker_id)``, if given."""
    for name in STOP_SIGNALS:
        signum = getattr(signal, name, None)
        if signum is not None:
            signal.signal(signum, signal.SIG_IGN)
    if then is not None:
        then(worker_id)


def worker_init_fn(rank: int) -> Callable[[int], None]:
    """:func:`ignore_stop_signals`, followed by Lightning's worker seeding when ``seed_everything(workers=True)``
    asked for it (Lightning adds it only to loaders without a ``worker_init_fn`` of their own)."""
    if int(os.environ.get("PL_SEED_WORKERS", 0)):
        from lightning.fabric.utilities.seed import pl_worker_init_function

        return partial(ignore_stop_signals, then=partial(pl_worker_init_function, rank=rank))
    return ignore_stop_signals
