"""Lightning's ``CheckpointIO`` plugin (``Trainer(plugins=[...])``): every write atomic and checksummed
(:func:`lit_minimind.checkpoint.atomic.atomic_save`), optionally in a background thread from a snapshot; every
read ``weights_only`` and verified; original MiniMind ``_resume.pth`` files read too, converted by
:func:`lit_minimind.checkpoint.weights.to_lightning`.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from lightning.fabric.plugins import TorchCheckpointIO

from lit_minimind.checkpoint.atomic import FileOps, atomic_save, file_ops, remove_file
from lit_minimind.checkpoint.names import MANIFEST_FIELDS, RESUME_STATE_KEY
from lit_minimind.checkpoint.weights import checkpoint_kind, to_lightning
from lit_minimind.errors import CheckpointError


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
    queued after it; :meth:`wait` returns once everything submitted is on disk. ``ops``: the file operations its
    writes go through (:class:`lit_minimind.checkpoint.atomic.FileOps`).
    """

    def __init__(self, async_writes: bool = False, ops: FileOps | None = None) -> None:
        super().__init__()
        self.async_writes, self.ops = async_writes, file_ops(ops)
        self._error: OSError | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._futures: list[Future] = []
        self._snapshot = Snapshot()
        self.start: Any = None  # the run's Start (lit_minimind.resume.start), set at setup: Lightning's restore loads it
        self.datamodule_type: type | None = None  # the run's DataModule class: its state's key (set at setup)

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Atomic write; an OSError is kept for :meth:`take_error` instead of raised, so that rank 0
        still reaches Lightning's barrier and the failure can stop every rank together."""
        meta = {k: checkpoint[k] for k in MANIFEST_FIELDS if k in checkpoint}
        state = (checkpoint.get("callbacks") or {}).get(RESUME_STATE_KEY, {})
        meta["run_id"], meta["identity"] = state.get("run_id"), state.get("identity")
        if self.async_writes:
            self.wait()  # the previous snapshot's buffers are reused: it must be on disk
            checkpoint = self._snapshot(checkpoint)
        self.submit(lambda: atomic_save(checkpoint, path, {"kind": "lightning", **meta}, self.ops))

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
        from lit_minimind.checkpoint.read import read_checkpoint  # here: a save never loads the reader
        from lit_minimind.resume.internals import adopt_data_state

        start, self.start = self.start, None  # Lightning's restore reads the start once; released after
        ckpt = start.load(path, map_location) if start is not None else None
        if ckpt is None:
            ckpt = read_checkpoint(path, map_location or "cpu")
        kind = checkpoint_kind(ckpt)
        if kind in ("lightning", "minimind_resume"):
            ckpt = ckpt if kind == "lightning" else to_lightning(ckpt)
            adopt_data_state(ckpt, self.datamodule_type)  # a user's subclass of the DataModule: its own key
            return ckpt
        if kind == "weights":
            raise CheckpointError(
                f"{path}: holds model weights only (an fp16 export?), not a resume checkpoint; "
                "pass the matching *_resume.pth or a Lightning .ckpt (or start from it with --from_weight)"
            )
        raise CheckpointError(f"{path}: not a lit-minimind, Lightning or MiniMind checkpoint (keys: {sorted(ckpt)[:8]})")

    def remove_checkpoint(self, path: Any) -> None:
        remove_file(path)


def callback_state(ckpt: dict[str, Any], key: str) -> dict[str, Any]:
    """A callback's state in a checkpoint (``{}`` when absent: original MiniMind's files, others')."""
    return dict((ckpt.get("callbacks") or {}).get(key) or {})


def saved_wandb_id(ckpt: dict[str, Any]) -> str | None:
    """The wandb run id a checkpoint carries (MiniMind's ``wandb_id`` key, ours and original MiniMind's)."""
    return ckpt.get("wandb_id") or callback_state(ckpt, RESUME_STATE_KEY).get("wandb_id")
