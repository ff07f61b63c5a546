"""ResumeCallback: MiniMind's dual checkpoint files plus Lightning's, and exact resume from any of them."""

from __future__ import annotations

import logging
import math
import time
import uuid
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lit_minimind.checkpoint import (
    EXTRA_KEY,
    FORMAT_VERSION,
    CheckpointError,
    checkpoint_stem,
    corrected_step,
    library_versions,
    manifest_path,
    read_checkpoint,
    read_manifest,
    save_resume_checkpoint,
    unwrap_model,
    verify_manifest,
)
from callbacks.preemption import StopRequest
from lit_minimind.lightning_io import RESUME_STATE_KEY, SafeCheckpointIO, fit_loop_state_at, rng_state, set_rng_state

log = logging.getLogger(__name__)


class ResumeCallback(Checkpoint):
    """Writes MiniMind's checkpoint files and makes every resume exact.

    Every ``save_interval`` batches of an epoch and at its last batch (MiniMind's
    ``step % save_interval == 0 or step == iters``) global rank 0 writes, atomically:
    ``{out_dir}/{weight}_{hidden}{_moe}.pth`` (fp16 weights), ``{ckpt_dir}/..._resume.pth``
    (MiniMind's resume dict plus our exact-resume extras) and a Lightning checkpoint
    ``{ckpt_dir}/{weight}_{hidden}{_moe}_e{epoch}_s{step}_g{global_step}.ckpt`` (the newest
    ``keep_last`` are kept). On resume (``trainer.fit(ckpt_path=...)``) it corrects the step
    for a changed world size, positions Lightning's loops, makes the data module skip the
    trained batches at index level and restores RNG state and partially accumulated gradients.

    Args:
        save_interval: save every this many batches of an epoch (MiniMind's ``save_interval``).
        out_dir: directory of the fp16 weight export (MiniMind's ``out``).
        ckpt_dir: directory of the resume checkpoints (MiniMind's ``checkpoints``).
        weight: file name prefix (MiniMind's ``save_weight``).
        keep_last: how many Lightning checkpoints to keep as a rolling window.
        save_every_minutes: also save when this many minutes passed since the last save.
    """

    def __init__(
        self,
        save_interval: int = 1000,
        out_dir: str = "out",
        ckpt_dir: str = "checkpoints",
        weight: str = "pretrain",
        keep_last: int = 2,
        save_every_minutes: float | None = None,
    ) -> None:
        if save_interval < 1:
            raise ValueError(f"save_interval must be >= 1, got {save_interval}")
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        self.save_interval = save_interval
        self.out_dir = Path(out_dir)
        self.ckpt_dir = Path(ckpt_dir)
        self.weight = weight
        self.keep_last = keep_last
        self.save_every_minutes = save_every_minutes
        self.dirpath = str(self.ckpt_dir)
        self.wandb_id: str | None = None
        self.resumed_from: dict[str, Any] | None = None
        self.saved_files: list[Path] = []
        self._state: dict[str, Any] = {}
        self._pending_restore: dict[str, Any] | None = None
        self._last_save_time = time.monotonic()
        self.stop_request = StopRequest()
        self.stopped_by: str | None = None
        self.best_val_loss: float | None = None
        self._last_trained: tuple[int, int] | None = None
        self.run_id = uuid.uuid4().hex[:12]  # carried across resumes; prune touches only this run's files
        self._last_saved: tuple[int, int] | None = None

    @property
    def state_key(self) -> str:
        return RESUME_STATE_KEY

    # ------------------------------------------------------------------ names
    def stem(self, pl_module: L.LightningModule) -> str:
        cfg = unwrap_model(pl_module).config
        return checkpoint_stem(self.weight, cfg.hidden_size, cfg.use_moe)

    def lightning_path(self, pl_module: L.LightningModule, epoch: int, step: int, global_step: int) -> Path:
        return self.ckpt_dir / f"{self.stem(pl_module)}_e{epoch}_s{step}_g{global_step}.ckpt"

    # ------------------------------------------------------------------ predicates
    def should_save(self, trainer: L.Trainer, step: int, iters: int) -> bool:
        """MiniMind's rule, plus the optional time-based cadence (agreed on by all ranks)."""
        if step % self.save_interval == 0 or step == iters:
            return True
        if self.save_every_minutes is None:
            return False
        due = time.monotonic() - self._last_save_time >= self.save_every_minutes * 60
        return bool(trainer.strategy.broadcast(due, src=0))

    def should_stop(self, trainer: L.Trainer, step: int, iters: int) -> bool:
        """A stop signal reached any rank and the current optimizer step is complete."""
        requested = self.stop_request.requested
        if trainer.world_size > 1:  # every rank must stop at the same step
            flag = torch.tensor([1.0 if requested else 0.0], device=trainer.strategy.root_device)
            requested = bool(trainer.strategy.reduce(flag, reduce_op="max").item() > 0)
        return requested and not self.is_mid_window(trainer, step, iters)

    @staticmethod
    def is_mid_window(trainer: L.Trainer, step: int, iters: int) -> bool:
        """True when gradients of this window are accumulated but not yet applied."""
        return not (step % trainer.accumulate_grad_batches == 0 or step == iters)

    # ------------------------------------------------------------------ hooks: setup/restore
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        trainer.strategy.checkpoint_io = SafeCheckpointIO()

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        state = (checkpoint.get("callbacks") or {}).get(self.state_key)
        if not state:
            return  # a Lightning checkpoint written without us: Lightning restores what it can
        self.check_same_data(trainer, state)
        self.warn_other_versions(state)
        world, saved_world = trainer.world_size, int(state.get("world_size") or 1)
        epoch, saved_step = int(state["epoch"]), int(state["step"])
        step = corrected_step(saved_step, saved_world, world)
        if saved_world != world:
            rank_zero_info(f"world size changed ({saved_world}→{world}): step {saved_step} → {step}")
        iters = trainer.datamodule.batches_per_epoch(world)
        saved_iters = int(state.get("iters") or trainer.datamodule.batches_per_epoch(saved_world))
        if saved_world == world and step > iters:
            raise CheckpointError(f"checkpoint is at step {step} of epoch {epoch + 1}, but an epoch has only {iters} batches here")
        if saved_step >= saved_iters:  # the epoch was complete, whatever its length on this world size
            step = iters
        step = min(step, iters)
        global_step = state.get("global_step")
        if global_step is None:  # original MiniMind file: count its optimizer steps
            global_step = epoch * math.ceil(iters / trainer.accumulate_grad_batches) + step // trainer.accumulate_grad_batches
        checkpoint["global_step"] = global_step
        # Lightning's loops are exact for our saves inside an epoch; MiniMind files carry none, a
        # changed world size moves the position, and a save at the end of training (max_steps,
        # max_time) records a finished epoch: then the position is rebuilt from ours
        if checkpoint.get("loops") is None or step != saved_step or state.get("saved_at_train_end"):
            checkpoint["loops"] = self._loops_at(trainer, epoch, step, iters, global_step)
        self._skip_trained_batches(trainer, epoch, step, iters)
        self.wandb_id = state.get("wandb_id")
        self.best_val_loss = state.get("best_val_loss")
        self.resumed_from = {"epoch": epoch, "step": step, "saved_step": saved_step, "world_size": saved_world,
                             "global_step": global_step, "source": state.get("source_format", "lightning")}
        grads = state.get("grads")
        if grads is not None and (saved_world != world or step != saved_step):
            rank_zero_warn("world size changed mid accumulation window: its partial gradients are dropped")
            grads = None
        if isinstance(grads, list):  # one dict per rank (DDP)
            grads = grads[trainer.global_rank]
        rng = state.get("rng")
        if isinstance(rng, list):  # one per rank (DDP): each rank its own, when the world is the same
            rng = rng[trainer.global_rank] if saved_world == world else rng[0]
        self.run_id = state.get("run_id") or self.run_id
        self._pending_restore = {"rng": rng, "grads": grads}

    @staticmethod
    def _loops_at(trainer: L.Trainer, epoch: int, step: int, iters: int, global_step: int) -> dict[str, Any] | None:
        template, accumulate = trainer.fit_loop.state_dict(), trainer.accumulate_grad_batches
        if step >= 1:
            return {"fit_loop": fit_loop_state_at(template, epoch, step, iters, accumulate, global_step)}
        if epoch > 0:  # nothing trained yet in this epoch: as if the previous one just ended
            return {"fit_loop": fit_loop_state_at(template, epoch - 1, iters, iters, accumulate, global_step)}
        return None

    @staticmethod
    def _skip_trained_batches(trainer: L.Trainer, epoch: int, step: int, iters: int) -> None:
        if 0 < step < iters:
            trainer.datamodule.resume_at(epoch, step)
            rank_zero_info(f"resuming epoch {epoch + 1} at step {step + 1}/{iters}: skipping {step} trained batches")
        else:
            next_epoch = epoch + 1 if step >= iters else epoch
            trainer.datamodule.resume_at(next_epoch, 0)
            rank_zero_info(f"resuming at the start of epoch {next_epoch + 1}")

    @staticmethod
    def check_same_data(trainer: L.Trainer, state: dict[str, Any]) -> None:
        """Fail before any training on another dataset (model shapes: ``LitMiniMind.on_load_checkpoint``)."""
        saved_len, dataset = state.get("dataset_len"), getattr(trainer.datamodule, "train_dataset", None)
        problems = []
        if saved_len is not None and dataset is not None and saved_len != len(dataset):
            problems.append(f"dataset length: checkpoint {saved_len} samples, this run {len(dataset)}")
        saved_batch, batch = state.get("batch_size"), getattr(trainer.datamodule, "batch_size", None)
        if saved_batch is not None and batch is not None and saved_batch != batch:
            problems.append(f"batch size: checkpoint {saved_batch}, this run {batch} (a step would mean other samples)")
        if problems:
            raise CheckpointError("checkpoint does not match this run (resume needs the same data):\n  "
                                  + "\n  ".join(problems))

    @staticmethod
    def warn_other_versions(state: dict[str, Any]) -> None:
        saved, current = state.get("versions") or {}, library_versions()
        for lib in ("torch", "lightning"):
            if saved.get(lib) and saved[lib] != current[lib]:
                rank_zero_warn(f"checkpoint was written with {lib} {saved[lib]}, this run uses {current[lib]}: "
                               "resume may not be bit-exact")

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._last_save_time = time.monotonic()
        self.stop_request.install()
        if getattr(trainer, "received_sigterm", False):  # arrived before our handler: Lightning's caught it
            trainer.received_sigterm = False
            self.stop_request.signal_name = "SIGTERM"
        self.describe_wandb_run(trainer)
        pending, self._pending_restore = self._pending_restore, None
        if not pending:
            return
        if pending.get("grads"):
            params = dict(pl_module.named_parameters())
            for name, grad in pending["grads"].items():
                params[name].grad = grad.to(device=params[name].device, dtype=params[name].dtype)
        if pending.get("rng") is not None:
            set_rng_state(pending["rng"])

    # ------------------------------------------------------------------ hooks: saving
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        step, iters = batch_idx + 1, int(trainer.num_training_batches)
        self._last_trained = (trainer.current_epoch, step)
        stop = self.should_stop(trainer, step, iters)
        if stop or (self.should_save(trainer, step, iters) and not self.validates_after(trainer, step, iters)):
            self.save(trainer, pl_module, trainer.current_epoch, step)
        if stop:
            self.stopped_by = self.stop_request.signal_name or "a signal on another rank"
            trainer.should_stop = True
            trainer.limit_val_batches = 0  # no validation in a preemption's grace period
            rank_zero_info(f"stopped by {self.stopped_by} after epoch {trainer.current_epoch + 1} step {step}/{iters}; "
                           "checkpoint saved. Resume with the same command plus --ckpt_path last")

    @staticmethod
    def validates_after(trainer: L.Trainer, step: int, iters: int) -> bool:
        """The epoch's last batch is followed by validation: save after it (``on_train_epoch_end``),
        so a resume does not skip that validation."""
        every = trainer.check_val_every_n_epoch
        return step == iters and trainer.enable_validation and (every is None or (trainer.current_epoch + 1) % every == 0)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._last_trained is not None and self._last_trained != self._last_saved:
            epoch, step = self._last_trained
            if step == int(trainer.num_training_batches):  # deferred past validation
                self.save(trainer, pl_module, epoch, step)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Training ended between save points (``max_steps``, ``max_time``): save where it stopped."""
        self.stop_request.uninstall()  # before Lightning restores the process's original handlers
        if self._last_trained is not None and self._last_trained != self._last_saved:
            self.save(trainer, pl_module, *self._last_trained, at_train_end=True)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.stop_request.uninstall()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """With a validation split: keep ``{stem}_best.ckpt``, the checkpoint with the lowest val loss."""
        val = trainer.callback_metrics.get("val_loss")
        if trainer.sanity_checking or val is None:
            return
        if self.best_val_loss is None or float(val) < self.best_val_loss:
            self.best_val_loss = float(val)
            self._state["best_val_loss"] = self.best_val_loss
            self.best_path = self.ckpt_dir / f"{self.stem(pl_module)}_best.ckpt"
            trainer.save_checkpoint(self.best_path, weights_only=False)
            rank_zero_info(f"new best val_loss {self.best_val_loss:.4f}: saved {self.best_path}")

    def state_dict(self) -> dict[str, Any]:
        return dict(self._state)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass  # everything is applied in on_load_checkpoint, which also sees the loop state

    # ------------------------------------------------------------------ actions
    def save(self, trainer: L.Trainer, pl_module: L.LightningModule, epoch: int, step: int,
             at_train_end: bool = False) -> None:
        """Write MiniMind's two files, then the Lightning checkpoint, for the state after ``step``.

        The Lightning checkpoint goes last: it is the commit record, so a kill anywhere in a save
        leaves either the previous position complete, or MiniMind's resume file (which resumes
        exactly too) one step ahead. A failed write stops every rank with the reason.
        """
        iters = int(trainer.num_training_batches)
        self.wandb_id = self._current_wandb_id(trainer) or self.wandb_id
        grads = self._partial_grads(trainer, pl_module) if self.is_mid_window(trainer, step, iters) else None
        self._state = {
            "epoch": epoch,
            "step": step,
            "world_size": trainer.world_size,
            "wandb_id": self.wandb_id,
            "global_step": trainer.global_step,
            "rng": self._gather(trainer, rng_state()),
            "grads": grads,
            "iters": iters,
            "batch_size": getattr(trainer.datamodule, "batch_size", None),
            "format": FORMAT_VERSION,
            "dataset_len": len(trainer.datamodule.train_dataset) if trainer.datamodule is not None else None,
            "versions": library_versions(),
            "best_val_loss": self.best_val_loss,
            "saved_at_train_end": at_train_end,
            "run_id": self.run_id,
        }
        error: OSError | None = None
        if trainer.is_global_zero:
            try:
                self._save_minimind_files(trainer, pl_module)
            except OSError as err:  # ENOSPC, EFBIG, EACCES, EROFS, ...
                error = err
        self._raise_if_failed(trainer, error, epoch, step)
        io = trainer.strategy.checkpoint_io
        trainer.save_checkpoint(self.lightning_path(pl_module, epoch, step, trainer.global_step), weights_only=False)
        self._raise_if_failed(trainer, getattr(io, "take_error", lambda: None)(), epoch, step)
        if trainer.is_global_zero:
            self.prune(pl_module)
        trainer.strategy.barrier("ResumeCallback.save")
        self._last_save_time = time.monotonic()
        self._last_saved = (epoch, step)

    def _raise_if_failed(self, trainer: L.Trainer, error: OSError | None, epoch: int, step: int) -> None:
        """Never train on without checkpoints: rank 0's write error stops every rank."""
        message = trainer.strategy.broadcast(str(error) if error else None, src=0)
        if message:
            raise CheckpointError(
                f"could not save the checkpoint at epoch {epoch + 1} step {step}: {message}. Training stopped; "
                f"the previous checkpoints in {self.ckpt_dir}/ and {self.out_dir}/ are intact "
                "(free space or fix permissions, then resume with --ckpt_path last)"
            )

    @staticmethod
    def _gather(trainer: L.Trainer, value: Any) -> Any:
        """``value`` of every rank (a list) under DDP, else ``value``."""
        if trainer.world_size == 1 or not dist.is_initialized():
            return value
        gathered: list[Any] = [None] * trainer.world_size
        dist.all_gather_object(gathered, value)
        return gathered

    def _save_minimind_files(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        model = unwrap_model(pl_module)
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        extra = {
            "format": FORMAT_VERSION,
            "model_fp32": {k: v.detach().cpu() for k, v in model.state_dict().items()},
            "callback": self._state,
            "hyper_parameters": dict(pl_module.hparams),
            "config": model.config.to_dict(),
            "versions": library_versions(),
        }
        weights, resume = save_resume_checkpoint(
            model,
            trainer.optimizers[0],
            save_dir=self.ckpt_dir,
            weights_dir=self.out_dir,
            weight=self.weight,
            hidden_size=model.config.hidden_size,
            use_moe=model.config.use_moe,
            epoch=self._state["epoch"],
            step=self._state["step"],
            scaler=scaler,
            extra_state={EXTRA_KEY: extra},
            wandb_id=self.wandb_id,
            world_size=trainer.world_size,
        )
        self.saved_files = [weights, resume]

    def prune(self, pl_module: L.LightningModule) -> None:
        """Keep the newest ``keep_last`` Lightning checkpoints of this run (never another run's files)."""
        ours = [p for p in self.ckpt_dir.glob(f"{self.stem(pl_module)}_e*_s*_g*.ckpt")
                if read_manifest(p).get("run_id") == self.run_id]
        for old in sorted(ours, key=save_order_key, reverse=True)[self.keep_last :]:
            SafeCheckpointIO().remove_checkpoint(old)

    def _partial_grads(self, trainer: L.Trainer, pl_module: L.LightningModule) -> Any:
        # DDP accumulates locally (no_sync) until the window ends: keep every rank's part
        local = {n: p.grad.detach().cpu().clone() for n, p in pl_module.named_parameters() if p.grad is not None}
        return self._gather(trainer, local)

    @staticmethod
    def _wandb_logger(trainer: L.Trainer) -> Any:
        return next((lg for lg in trainer.loggers if lg.__class__.__name__ == "WandbLogger"), None)

    def _current_wandb_id(self, trainer: L.Trainer) -> str | None:
        logger = self._wandb_logger(trainer)
        return str(logger.experiment.id) if logger is not None and trainer.is_global_zero else None

    def attach_wandb_run(self, trainer: L.Trainer, run_id: str | None) -> None:
        """Make a WandbLogger continue the checkpoint's run, unless the user chose an id.

        Call before ``trainer.fit``: Lightning starts the run before it restores callbacks
        (``python -m lit_minimind.fit`` does this; see :func:`lit_minimind.checkpoint.peek_wandb_id`).
        """
        logger = self._wandb_logger(trainer)
        if logger is None:
            return
        chosen = logger._wandb_init.get("id")
        if chosen and chosen != run_id:
            rank_zero_info(f"wandb: logging to the run id you chose ({chosen}), not the checkpoint's ({run_id})")
        elif run_id is None:
            rank_zero_info("wandb: the checkpoint has no wandb run id: starting a new run (its id goes into the next checkpoint)")
        elif getattr(logger, "_experiment", None) is not None:
            rank_zero_warn(f"wandb: run {logger._experiment.id} already started; cannot re-attach to {run_id}")
        else:
            logger._wandb_init.update(id=run_id, resume="allow")  # no public API before the run starts
            logger._id = run_id
            rank_zero_info(f"wandb: continuing run {run_id}")

    def describe_wandb_run(self, trainer: L.Trainer) -> None:
        """One step axis for every metric (``micro_step``) and, on resume, where it resumed from."""
        logger = self._wandb_logger(trainer)
        if logger is None or not trainer.is_global_zero:
            return
        run = logger.experiment
        run.define_metric("micro_step")
        run.define_metric("*", step_metric="micro_step")
        self.wandb_id = str(run.id)
        if self.resumed_from is not None:
            record = {**self.resumed_from, "checkpoint": str(trainer.ckpt_path), "world_size_now": trainer.world_size}
            run.config.update({f"resume_at_global_step_{self.resumed_from['global_step']}": record}, allow_val_change=True)


def save_order_key(path: Path) -> tuple[int, bool]:
    """When a checkpoint was saved (manifest time, else file mtime); on a tie the Lightning one first."""
    saved_at = read_manifest(path).get("saved_at")
    if saved_at is None:
        saved_at = path.stat().st_mtime_ns if path.exists() else 0
    return int(saved_at), path.suffix == ".ckpt"


def resolve_last(ckpt_dir: str | Path, stem: str) -> Path | None:
    """The most recently saved valid resume checkpoint of ``stem`` in ``ckpt_dir``, or ``None``.

    Candidates: our Lightning checkpoints and MiniMind's ``{stem}_resume.pth`` (ours, or one
    written by original MiniMind). The newest save wins, as Lightning's own ``last`` does; a
    file that is truncated, corrupted or unreadable is skipped with a warning naming it and why.
    """
    ckpt_dir = Path(ckpt_dir)
    minimind_resume = ckpt_dir / f"{stem}_resume.pth"  # checkpoint_paths' name, from the stem
    candidates = list(ckpt_dir.glob(f"{stem}_e*_s*_g*.ckpt"))
    if minimind_resume.exists():
        candidates.append(minimind_resume)
    for path in sorted(candidates, key=save_order_key, reverse=True):
        try:
            verify_manifest(path) if manifest_path(path).exists() else read_checkpoint(path)
        except CheckpointError as err:
            rank_zero_warn(f"skipping checkpoint {err}")
            continue
        return path
    return None
