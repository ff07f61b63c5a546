"""DataLoader worker processes never act on a stop signal: the main process owns the stop."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from functools import partial

STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1")


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
