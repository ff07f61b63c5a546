"""Test-only callbacks that make a training run hang or crawl at a chosen moment (tests/test_watchdog.py).

Given as ``--trainer.callbacks+=tests.helpers.hang.NAME --trainer.callbacks.ARG=V``; each prints an
``@@`` line to stdout when it acts, so a test waits on output, not on time.
"""

from __future__ import annotations

import ctypes
import os
import signal
import statistics
import sys
import threading
import time
from typing import Any

import lightning as L
from torch.utils.data import Dataset, get_worker_info


class _HangingRecords(Dataset):
    """The training records, except that a DataLoader worker's ``item``-th fetch never returns."""

    def __init__(self, records: Any, item: int) -> None:
        self.records, self.item, self.fetched = records, item, 0

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> Any:
        if get_worker_info() is not None:  # in a worker process only (the main one never hangs itself)
            self.fetched += 1
            if self.fetched == self.item:
                print(f"@@hanging-in-data worker {os.getpid()} index {index}", flush=True)
                threading.Event().wait()  # a read from a filesystem that stopped answering
        return self.records[index]

    def __getattr__(self, name: str) -> Any:
        if name == "records":
            raise AttributeError(name)
        return getattr(self.records, name)


class HangInData(L.Callback):
    """A DataLoader worker blocks forever at its ``item``-th record (1-based; needs ``--data.num_workers >= 1``)."""

    def __init__(self, item: int) -> None:
        self.item = item

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        data = trainer.datamodule
        data.train_dataset = _HangingRecords(data.train_dataset, self.item)


class SlowSteps(L.Callback):
    """The run's first batch waits ``first`` seconds (a slow start-up: compile, a cold cache); batch
    ``slow_batch`` (1-based, of the first epoch) waits ``times`` x the median of the batch times so far."""

    def __init__(self, first: float, slow_batch: int, times: float) -> None:
        self.first, self.slow_batch, self.times = first, slow_batch, times
        self.seen = 0
        self.durations: list[float] = []
        self.started: float | None = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self.seen += 1
        if self.seen == 1:
            print(f"@@slow-first-batch {self.first:.2f} s", flush=True)
            time.sleep(self.first)  # the slowness under test, not a synchronisation
        elif self.seen == self.slow_batch:
            median = statistics.median(self.durations)
            print(f"@@slow-batch {self.seen}: {self.times:g} x median {median:.3f} s = {self.times * median:.2f} s",
                  flush=True)
            time.sleep(self.times * median)
        self.started = time.monotonic()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.started is not None and self.seen > 1:
            self.durations.append(time.monotonic() - self.started)


class HoldTheGil(L.Callback):
    """At batch ``batch`` (1-based) the main thread enters a C call that keeps the GIL (libc's ``sleep``
    through ``ctypes.PyDLL``): no Python thread runs any more, the watchdog's included."""

    def __init__(self, batch: int) -> None:
        self.batch, self.seen = batch, 0

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self.seen += 1
        if self.seen == self.batch:
            print("@@holding-the-gil", flush=True)
            ctypes.PyDLL(None).sleep(3600)


class StopSelf(L.Callback):
    """Global rank ``rank`` SIGSTOPs itself at batch ``batch`` (1-based), in the first attempt of a torchrun
    job only (``TORCHELASTIC_RESTART_COUNT`` 0): a machine that stops answering, once."""

    def __init__(self, rank: int, batch: int) -> None:
        self.rank, self.batch, self.seen = rank, batch, 0

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self.seen += 1
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if self.seen == self.batch and trainer.global_rank == self.rank and first_attempt:
            print(f"@@stopping-self rank {self.rank} pid {os.getpid()}", flush=True)
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGSTOP)
