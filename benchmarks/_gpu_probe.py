"""``python -m lit_minimind.fit`` with a timed window and timed saves: the real CLI, plus one ``@@gpu`` line.

Used by :mod:`benchmarks.bench_gpu`. Without changing what the CLI does, it wraps
:meth:`MiniMindConsole.on_train_batch_end` (after the console's own work, before the
:class:`ResumeCallback`'s, which Lightning runs last) and :meth:`ResumeCallback.save`:

* the timed window starts at the end of micro-batch ``$BENCH_GPU_WARMUP`` of this process and ends
  at the end of the micro-batch that reaches ``--trainer.max_steps``; the device is synchronized
  at both ends (only there), so the window holds the GPU work of its batches;
* every save is timed from a device sync before it to a device sync after it: how long it holds
  the training loop (with ``async_save`` the snapshot; the file write runs in the background).

At the end of training it prints ``@@gpu {json}``: the window, the saves, the last loss, the
device, the peak device memory and whether deterministic algorithms were on.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from typing import Any


def install() -> None:
    import torch

    from lit_minimind.callbacks.console import MiniMindConsole
    from lit_minimind.callbacks.resume import ResumeCallback

    warmup = int(os.environ.get("BENCH_GPU_WARMUP", "1"))
    state: dict[str, Any] = {"batches": 0, "window_start": None, "window_end": None, "saves": [], "tokens_per_batch": 0}

    def sync() -> None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    batch_end = MiniMindConsole.on_train_batch_end

    def timed_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # noqa: ANN001
        result = batch_end(self, trainer, pl_module, outputs, batch, batch_idx)
        state["batches"] += 1
        state["tokens_per_batch"] = int(batch[1].numel())
        if state["batches"] == warmup:
            sync()
            state["window_start"] = (time.perf_counter(), state["batches"])
        if state["window_end"] is None and 0 < trainer.max_steps <= trainer.global_step:
            sync()
            state["window_end"] = (time.perf_counter(), state["batches"])
        return result

    MiniMindConsole.on_train_batch_end = timed_batch_end

    save = ResumeCallback.save

    def timed_save(self, trainer, pl_module):  # noqa: ANN001
        before = self._last_saved
        sync()
        start = time.perf_counter()
        try:
            return save(self, trainer, pl_module)
        finally:
            sync()
            if self._last_saved != before:  # not a repeated call at the same position (nothing saved)
                state["saves"].append({"global_step": int(trainer.global_step), "start": start,
                                       "s": time.perf_counter() - start, "async": bool(self.async_save)})

    ResumeCallback.save = timed_save

    train_end = MiniMindConsole.on_train_end

    def report(self, trainer, pl_module):  # noqa: ANN001
        result = train_end(self, trainer, pl_module)
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        start, end = state["window_start"], state["window_end"]
        info = {
            "window_s": end[0] - start[0] if start and end else None,
            "window_batches": end[1] - start[1] if start and end else None,
            "window_start": start[0] if start else None,
            "window_end": end[0] if end else None,
            "batches": state["batches"],
            "tokens_per_batch": state["tokens_per_batch"],
            "saves": state["saves"],
            "last_loss": self.last_loss,
            "global_step": int(trainer.global_step),
            "params": int(pl_module.model.num_parameters()),
            "device": torch.cuda.get_device_name() if cuda else (platform.processor() or platform.machine()),
            "peak_memory_bytes": int(torch.cuda.max_memory_allocated()) if cuda else None,
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
            "precision": str(trainer.precision),
        }
        print("@@gpu " + json.dumps(info), flush=True)
        return result

    MiniMindConsole.on_train_end = report


if __name__ == "__main__":
    import lit_minimind.cli.fit as fit

    install()
    sys.exit(fit.main(sys.argv[1:]))
