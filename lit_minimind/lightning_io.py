"""Lightning's side of checkpoints: the storage plugin, and loop state for foreign positions.

* :class:`SafeCheckpointIO` - Lightning's ``CheckpointIO`` plugin (``Trainer(plugins=[...])``):
  every write atomic and checksummed (:func:`lit_minimind.checkpoint.atomic_save`), every read
  ``weights_only`` and verified; it also reads original MiniMind ``_resume.pth`` files, converted
  by :func:`lit_minimind.minimind_format.to_lightning`.
* :func:`loops_at` - loop counters for a position Lightning did not save itself. Lightning has
  no API to set a loop position, so this is written against the counters Lightning 2.5/2.6 save.
* :func:`rng_state` / :func:`set_rng_state` - every RNG a training step draws from.
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from lightning.fabric.plugins import TorchCheckpointIO

from lit_minimind.checkpoint import CheckpointError, atomic_save, checkpoint_kind, manifest_path, read_checkpoint
from lit_minimind.position import DataPosition

MANIFEST_FIELDS = ("epoch", "step", "world_size", "global_step", "wandb_id")


def fit_loop_state_at(template: dict[str, Any], position: DataPosition, accumulate: int, global_step: int) -> dict[str, Any]:
    """Fit-loop state as Lightning saves it after ``position`` (at least one batch trained).

    Inside an epoch: the state of a save in ``on_train_batch_end`` of batch ``position.step``; a
    complete epoch: the state of a save in ``on_train_epoch_end``. ``template`` is a fresh
    ``trainer.fit_loop.state_dict()``, ``global_step`` the optimizer steps taken so far.
    ``tests/test_loop_state.py`` checks both against states Lightning saved itself.
    """
    epoch, step, iters = position.epoch, position.step, position.iters
    if step < 1:
        raise ValueError("fit_loop_state_at needs a position after at least one batch")
    state = copy.deepcopy(template)
    end = position.epoch_complete
    stepped = step % accumulate == 0 or step == iters
    steps_in_epoch = step // accumulate + (1 if step == iters and step % accumulate else 0)
    windows_in_epoch = math.ceil(step / accumulate)
    windows_before = epoch * math.ceil(iters / accumulate)

    def batches(total: int) -> dict[str, int]:
        return {"ready": total, "completed": total if end else total - 1, "started": total, "processed": total}

    state["epoch_loop.state_dict"] = {"_batches_that_stepped": global_step - (1 if stepped and not end else 0)}
    state["epoch_loop.batch_progress"] = {
        "total": batches(epoch * iters + step), "current": batches(step), "is_last_batch": step == iters,
    }
    optim = state["epoch_loop.automatic_optimization.optim_progress"]["optimizer"]
    optim["step"] = {
        "total": {"ready": global_step, "completed": global_step},
        "current": {"ready": steps_in_epoch, "completed": steps_in_epoch},
    }
    zg_total, zg_current = windows_before + windows_in_epoch, windows_in_epoch
    optim["zero_grad"] = {
        "total": {"ready": zg_total, "completed": zg_total, "started": zg_total},
        "current": {"ready": zg_current, "completed": zg_current, "started": zg_current},
    }
    epochs = {"ready": epoch + 1, "completed": epoch, "started": epoch + 1, "processed": epoch + (1 if end else 0)}
    state["epoch_progress"] = {"total": dict(epochs), "current": dict(epochs)}
    return state


def loops_at(template: dict[str, Any], position: DataPosition, accumulate: int, global_step: int) -> dict[str, Any] | None:
    """``checkpoint["loops"]`` for a position Lightning did not save itself (a MiniMind file, a changed
    world size): the one place where loop counters are built by hand. ``None`` before any batch."""
    if position.step >= 1:
        return {"fit_loop": fit_loop_state_at(template, position, accumulate, global_step)}
    if position.epoch > 0:  # nothing trained yet in this epoch: the previous one is complete
        previous = DataPosition(position.epoch - 1, position.iters, position.iters)
        return {"fit_loop": fit_loop_state_at(template, previous, accumulate, global_step)}
    return None


class Snapshot:
    """Copies a checkpoint dict so training can go on while it is written: containers copied, tensors
    copied to CPU (pinned memory on CUDA), shared objects and storages kept shared (``torch.save``
    still writes each once). The copy's buffers are reused by the next snapshot, matched by shape and
    dtype - the same state has the same tensors - so a save does not pay for fresh memory each time
    (a buffer the next snapshot has no tensor for is freed); the caller makes sure the previous copy
    was written before taking the next one."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []
        self._used: list[torch.Tensor] = []
        self._free: dict[tuple[Any, ...], list[torch.Tensor]] = {}

    @property
    def nbytes(self) -> int:
        """Memory the copy holds between saves (one checkpoint's tensors)."""
        return sum(b.untyped_storage().nbytes() for b in self._buffers)

    def __call__(self, obj: Any) -> Any:
        self._free = {}
        for buffer in self._buffers:
            self._free.setdefault((tuple(buffer.shape), buffer.dtype, buffer.is_pinned()), []).append(buffer)
        self._used = []
        copied = self._copy(obj, {})
        self._buffers, self._free = self._used, {}
        if any(b.is_pinned() for b in self._used):
            torch.cuda.synchronize()  # the device-to-host copies are complete before the writer reads them
        return copied

    def _copy(self, obj: Any, memo: dict[Any, Any]) -> Any:
        if isinstance(obj, torch.Tensor):
            key = (obj.untyped_storage().data_ptr(), obj.storage_offset(), tuple(obj.shape), tuple(obj.stride()), obj.dtype)
            if key not in memo:
                memo[key] = self._tensor(obj)
            return memo[key]
        if isinstance(obj, (dict, list, tuple)) and not hasattr(obj, "_fields"):
            if id(obj) not in memo:
                items = obj.items() if isinstance(obj, dict) else enumerate(obj)
                copied = {k: self._copy(v, memo) for k, v in items}
                memo[id(obj)] = copied if isinstance(obj, dict) else type(obj)(copied.values())
            return memo[id(obj)]
        return obj

    def _tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        free = self._free.get((tuple(tensor.shape), tensor.dtype, tensor.is_cuda))
        buffer = free.pop() if free else torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
        buffer.copy_(tensor.detach(), non_blocking=tensor.is_cuda)
        self._used.append(buffer)
        return buffer


class SafeCheckpointIO(TorchCheckpointIO):
    """Lightning checkpoint storage: atomic, checksummed writes; ``weights_only``, verified reads;
    original MiniMind resume files converted on load.

    With ``async_writes`` a save blocks only for a :class:`Snapshot`; serialization, checksum, fsync and
    rename run on one background thread, in submission order, followed by whatever :meth:`submit`
    queues (MiniMind's files). A failed write is kept for :meth:`take_error` and skips the jobs
    queued after it; :meth:`wait` returns once everything submitted is on disk.
    """

    def __init__(self, async_writes: bool = False) -> None:
        super().__init__()
        self.async_writes = async_writes
        self._error: OSError | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._futures: list[Future] = []
        self._snapshot = Snapshot()

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Atomic write; an OSError is kept for :meth:`take_error` instead of raised, so that rank 0
        still reaches Lightning's barrier and the failure can stop every rank together."""
        meta = {k: checkpoint[k] for k in MANIFEST_FIELDS if k in checkpoint}
        meta["run_id"] = (checkpoint.get("callbacks") or {}).get("ResumeCallback", {}).get("run_id")
        if self.async_writes:
            self.wait()  # the previous snapshot's buffers are reused: it must be on disk
            checkpoint = self._snapshot(checkpoint)
        self.submit(lambda: atomic_save(checkpoint, path, {"kind": "lightning", **meta}))

    def submit(self, job: Callable[[], Any]) -> None:
        """Run ``job`` after the writes already submitted (at once when writes are synchronous); an
        OSError it raises is kept for :meth:`take_error`, and later jobs are skipped."""
        def guarded() -> None:
            if self._error is not None:
                return
            try:
                job()
            except OSError as err:  # ENOSPC, EFBIG, EACCES, EROFS, EIO, ...
                self._error = err

        if not self.async_writes:
            guarded()
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        self._futures.append(self._executor.submit(guarded))

    def wait(self) -> None:
        """Block until every submitted write is on disk (re-raises a non-OS error of a write)."""
        futures, self._futures = self._futures, []
        for future in futures:
            future.result()

    @property
    def snapshot_bytes(self) -> int:
        """Host memory held by the asynchronous snapshot between saves (0 for synchronous writes)."""
        return self._snapshot.nbytes

    @property
    def failed(self) -> bool:
        """A write failed (cheap: no waiting, no collective)."""
        return self._error is not None

    def take_error(self) -> OSError | None:
        """The error of the last failed write (then cleared), or None."""
        error, self._error = self._error, None
        return error

    def teardown(self) -> None:
        self.wait()

    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None) -> dict[str, Any]:
        from lit_minimind.minimind_format import to_lightning

        ckpt = read_checkpoint(path, map_location or "cpu")
        kind = checkpoint_kind(ckpt)
        if kind == "lightning":
            return ckpt
        if kind == "minimind_resume":
            return to_lightning(ckpt)
        if kind == "weights":
            raise CheckpointError(
                f"{path}: holds model weights only (an fp16 export?), not a resume checkpoint; "
                "pass the matching *_resume.pth or a Lightning .ckpt (or start from it with --from_weight)"
            )
        raise CheckpointError(f"{path}: not a lit-minimind, Lightning or MiniMind checkpoint (keys: {sorted(ckpt)[:8]})")

    def remove_checkpoint(self, path: Any) -> None:
        for p in (path, manifest_path(path)):
            try:
                os.remove(p)
            except FileNotFoundError:
                pass


def rng_state() -> dict[str, Any]:
    """Every RNG a training step may draw from, as plain tensors (loadable with ``weights_only``)."""
    import random

    import numpy as np

    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (np_state[0], torch.from_numpy(np_state[1].astype("int64")), *np_state[2:]),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import random

    import numpy as np

    torch.set_rng_state(state["torch"])
    python = state["python"]
    random.setstate((python[0], tuple(python[1]), python[2]))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


__all__ = ["SafeCheckpointIO", "fit_loop_state_at", "loops_at", "rng_state", "set_rng_state"]
