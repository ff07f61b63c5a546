"""ResumeCallback: MiniMind's checkpoint files from Lightning's own checkpoint, and exact resume from them.

Composed of small units, each with one job: :class:`lit_minimind.callbacks.schedule.SaveSchedule` (when),
:class:`lit_minimind.callbacks.files.CheckpointFiles` (names, retention, MiniMind's files),
:mod:`lit_minimind.checkpoint.weights` (MiniMind's keys), :data:`lit_minimind.callbacks.preemption.STOP` (signals),
:mod:`lit_minimind.callbacks.log_history` (the logger's run). Lightning keeps the rest: the data position in the
DataModule's ``state_dict``, loop counters, optimizer, scaler, this callback's ``state_dict``.
"""

from __future__ import annotations

import contextlib
import sys
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lit_minimind.callbacks.console import MiniMindConsole
from lit_minimind.callbacks.files import CheckpointFiles, agree_on_checkpoint
from lit_minimind.callbacks.log_history import continue_wandb_run, describe_wandb_run, resume_record, wandb_run_id
from lit_minimind.callbacks.preemption import STOP
from lit_minimind.callbacks.preflight import check_at_setup
from lit_minimind.callbacks.remote import RemoteCheckpoints, choose_with_remote, staging_dir
from lit_minimind.callbacks.schedule import SaveSchedule
from lit_minimind.checkpoint.names import (
    CALLBACK_FORMAT_VERSION,
    RESUME_STATE_KEY,
    TRAINING_STATE_KEY,
    CheckpointName,
    checkpoint_stem,
)
from lit_minimind.checkpoint.weights import add_minimind_keys, fp16_weights, unwrap_model
from lit_minimind.errors import CheckpointError
from lit_minimind.resume.internals import (
    NO_LAST_WARNING,
    AnswersLast,
    DeferredStop,
    after_lightning_handlers,
    batches_done,
    before_lightning_handlers,
    loops_at,
)
from lit_minimind.resume.io import SafeCheckpointIO, read_start_checkpoint, saved_wandb_id
from lit_minimind.resume.library import library_versions
from lit_minimind.resume.states import (
    adopt_scaler_state,
    optimizer_steps,
    rank_rng_state,
    save_rank_states,
    set_rng_state,
    window_complete,
    world_size_change,
)


class ResumeCallback(AnswersLast):
    """Writes MiniMind's checkpoint files and makes every resume exact; alone in a Trainer it is enough.

    ``trainer.fit(model, datamodule=dm, ckpt_path="last")`` resumes from the newest valid checkpoint of
    ``ckpt_dir`` (a damaged one skipped with a line, MiniMind's ``_resume.pth`` accepted, a URL
    directory's newest downloaded), continues the run's wandb run and CSV log directory, and starts
    fresh (saying so) when there is none. The callback installs its checkpoint storage
    (:class:`lit_minimind.resume.io.SafeCheckpointIO`: atomic, verified, reads MiniMind's files) as the
    strategy's ``checkpoint_io`` at setup, and its stop-signal handling.

    Every ``save_interval`` batches of an epoch and at its end (MiniMind's ``step % save_interval
    == 0 or step == iters``), on a stop signal at the next optimizer-step boundary, and where
    training stops (``max_steps``, ``max_time``), global rank 0 writes atomically, in this order:
    ``{ckpt_dir}/{stem}_e{epoch}_s{step}_g{global_step}_{run_id}.ckpt`` (Lightning's checkpoint,
    also MiniMind's resume dict: the commit record), ``{ckpt_dir}/{stem}_resume.pth`` (a hard link
    to it) and ``{out_dir}/{stem}.pth`` (fp16 weights). ``stem`` is ``{weight}_{hidden}{_moe}``.

    Args:
        save_interval: save every this many batches of an epoch (MiniMind's ``save_interval``).
        out_dir: directory of the fp16 weight export (MiniMind's ``out``).
        ckpt_dir: directory of the resume checkpoints (MiniMind's ``checkpoints``).
        weight: file name prefix (MiniMind's ``save_weight``).
        keep_last: how many checkpoints of this run to keep as a rolling window: each run (a fresh start and
            its resumes, one run id) keeps its own newest ``keep_last``; other runs' files are never pruned by it.
        keep_runs: also bound the runs: at a run's first save, the checkpoints of all but the newest
            ``keep_runs`` runs of this ``ckpt_dir`` and stem are removed (this run's never). Unset: every run's stay.
        save_every_minutes: also save when this many minutes passed since the last save; ``"auto"``: every
            Young/Daly interval ``sqrt(2 * save cost * MTBF)``, at least 20 save costs (schedule.SaveSchedule).
        mtbf: with ``save_every_minutes="auto"``: the mean time between interruptions, in seconds (unset:
            the run's own, from its resumes; with none yet 1 h).
        async_save: write in the background: the loop blocks only to snapshot the state (at most one
            save in flight; a failed write stops training at the next optimizer step).
        upload_timeout: with a remote ``ckpt_dir``/``out_dir`` (an fsspec URL, :mod:`lit_minimind.callbacks.remote`): how
            many seconds the end of the run waits for the newest save's upload.
    """

    def __init__(self, save_interval: int = 1000, out_dir: str = "out", ckpt_dir: str = "checkpoints",
                 weight: str = "pretrain", keep_last: int = 2, save_every_minutes: float | str | None = None,
                 async_save: bool = True, upload_timeout: float = 300.0, keep_runs: int | None = None,
                 mtbf: float | None = None) -> None:
        self.schedule = SaveSchedule(save_interval, save_every_minutes, mtbf)
        # a URL directory: the files are written to a local staging directory, then uploaded (callbacks.remote)
        self.remote = RemoteCheckpoints.of(ckpt_dir, out_dir, keep_last)
        if upload_timeout < 0:
            raise ValueError(f"--resume.upload_timeout must be >= 0 seconds, got {upload_timeout}")
        self.upload_timeout = upload_timeout
        self.files = CheckpointFiles(staging_dir("ckpt_dir", ckpt_dir), staging_dir("out_dir", out_dir), weight, keep_last,
                                     keep_runs)
        super().__init__(str(self.files.ckpt_dir))  # Lightning asks it what ckpt_path="last" means (AnswersLast)
        self.async_save = async_save
        self._in_flight = ""  # what the save being written is, for its error message
        self.run_id = uuid.uuid4().hex[:8]  # carried across resumes: a fresh run never touches another's files
        self.wandb_id: str | None = None
        self.best_val_loss: float | None = None
        self.resumed_from: dict[str, Any] | None = None
        self.resume_records: dict[str, Any] = {}  # every resume of this run (checkpointed; for the wandb config)
        self.stopped_by: str | None = None
        self.saved_files: list[Path] = []
        self._pending_rng: Any = None  # this rank's RNG state, set at train start
        self._save_due = False  # a save fell due inside an accumulation window: taken at its optimizer step
        self._best_due = False  # likewise for a new best validation loss
        self._end = DeferredStop()  # likewise for a max_time stop
        self._export: dict[str, torch.Tensor] | None = None
        self._last_saved: tuple[int, int] | None = None
        self._chosen_here: str | None = None  # this rank's choice (choose)
        self._start: tuple[str, dict[str, Any]] | None = None  # rank 0: the chosen checkpoint, read once
        self.save_seconds: tuple[float, float | None] = (0.0, None)  # the last save: loop's wait, until committed
        self.remote_holds = True  # a remote directory holds the newest save (checked at the end of the fit)

    # the CLI's --resume.* flags
    @property
    def save_interval(self) -> int:
        return self.schedule.save_interval

    @property
    def ckpt_dir(self) -> Path:
        return self.files.ckpt_dir

    @property
    def out_dir(self) -> Path:
        return self.files.out_dir

    @property
    def weight(self) -> str:
        return self.files.weight

    @property
    def state_key(self) -> str:
        return RESUME_STATE_KEY

    def stem(self, pl_module: L.LightningModule) -> str:
        cfg = unwrap_model(pl_module).config
        return checkpoint_stem(self.files.weight, cfg.hidden_size, cfg.use_moe)

    # ------------------------------------------------------------------ state (Lightning saves and restores it)
    def state_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "wandb_id": self.wandb_id, "best_val_loss": self.best_val_loss,
                "resume_records": dict(self.resume_records), "format": CALLBACK_FORMAT_VERSION, "versions": library_versions(),
                "schedule": self.schedule.state_dict()}  # the run's seconds and starts (its MTBF), save costs

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.run_id = state_dict.get("run_id") or self.run_id
        self.schedule.load_state_dict(state_dict.get("schedule"))
        self.wandb_id = state_dict.get("wandb_id")
        self.best_val_loss = state_dict.get("best_val_loss")
        self.resume_records = dict(state_dict.get("resume_records") or {})
        for lib, version in (state_dict.get("versions") or {}).items():
            if lib in ("torch", "lightning") and version != library_versions()[lib]:
                rank_zero_warn(f"checkpoint was written with {lib} {version}, this run uses "
                               f"{library_versions()[lib]}: resume may not be bit-exact")

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        """Add MiniMind's keys and each rank's RNG (gathered to rank 0). ResumeCallback saves only at
        optimizer-step boundaries, where no gradient is pending."""
        step = batches_done(trainer)
        iters = int(trainer.num_training_batches)
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if not window_complete(step, iters, trainer.accumulate_grad_batches):
            rank_zero_warn("a checkpoint saved inside an accumulation window (trainer.save_checkpoint outside "
                           "ResumeCallback) holds no partial gradients: its resume restarts the window's gradients")
        checkpoint[TRAINING_STATE_KEY] = save_rank_states(trainer)
        if trainer.is_global_zero:  # the rank that writes (DDP discards the others' dicts): no fp16 copy elsewhere
            self._export = add_minimind_keys(checkpoint, step=step, world_size=trainer.world_size,
                                             wandb_id=self.wandb_id,
                                             scaler_state=scaler.state_dict() if scaler is not None else None)

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        """Lightning restored the data position (the DataModule's state); complete what a foreign
        checkpoint lacks (loop counters of an original MiniMind file or of a changed world size)."""
        adopt_scaler_state(checkpoint, trainer.precision_plugin)  # written under another precision plugin
        datamodule = trainer.datamodule
        position, saved = getattr(datamodule, "position", None), getattr(datamodule, "saved_position", None)
        if position is None or saved is None:
            return  # a Lightning checkpoint written without our DataModule: Lightning restores what it can
        saved_world, world = int(saved.get("world_size") or 1), trainer.world_size
        change = world_size_change(int(saved["step"]), saved_world, world, position.step)
        if change:
            rank_zero_info(change)
        translated = saved_world != world or position.step != int(saved["step"])
        accumulate = trainer.accumulate_grad_batches
        if checkpoint.get("loops") is None or translated:
            if checkpoint.get("global_step") is None or saved_world != world:
                # an original MiniMind file, or steps of another world size: this world's optimizer steps up to
                # the position, so --trainer.max_steps and the LR schedule count one kind of step
                steps_here = optimizer_steps(position, accumulate)
                if checkpoint.get("global_step") is not None and trainer.max_steps > 0:
                    rank_zero_info(f"global step {checkpoint['global_step']} on {saved_world} → {steps_here} on {world} "
                                   f"process(es); --trainer.max_steps {trainer.max_steps} counts optimizer steps of "
                                   f"{world} process(es): training and its LR schedule end at step {trainer.max_steps}")
                checkpoint["global_step"] = steps_here
            checkpoint["loops"] = loops_at(trainer.fit_loop.state_dict(), position, accumulate, checkpoint["global_step"])
        rank_zero_info(position.describe())
        source = (checkpoint.get("callbacks") or {}).get(self.state_key, {}).get("source_format", "lightning")
        self.resumed_from = {"epoch": position.epoch, "step": position.step, "saved_step": int(saved["step"]),
                             "world_size": saved_world, "global_step": checkpoint["global_step"], "source": source}
        if not window_complete(position.step, position.iters, accumulate):  # a MiniMind file, an older one of ours
            rank_zero_warn(f"the checkpoint was saved inside an accumulation window (step {position.step}, "
                           f"{accumulate} batches per optimizer step) and holds no partial gradients (as MiniMind's "
                           "own resume): this window's optimizer step sums only the batches from here")
        self._pending_rng = rank_rng_state(checkpoint.get(TRAINING_STATE_KEY) or {}, trainer.global_rank)

    # ------------------------------------------------------------------ start
    def choose(self, trainer: L.Trainer, pl_module: L.LightningModule, ckpt_path: str | None) -> str | None:
        """The checkpoint this run starts from, before ``trainer.fit`` starts the loggers: ``"last"`` (the
        newest valid one of ``ckpt_dir``, the remote's included; None when there is none: a fresh start,
        said once), a file, or None. On global rank 0 the file is verified and read once: the wandb run
        and the CSV log directory it names are continued, and Lightning's restore takes this read.

        ``trainer.fit(ckpt_path="last")`` calls it (through :meth:`_find_last_checkpoints`); call it
        yourself and pass its result as ``ckpt_path`` to continue the loggers of a checkpoint named by path.
        """
        self._start = None
        if trainer.is_global_zero and self.remote is not None:
            self.remote.uploader.start()  # the upload process starts up while the trainer does
        chosen = choose_with_remote(ckpt_path, self.remote, self.files.ckpt_dir, self.stem(pl_module), trainer.global_rank)
        self._chosen_here = chosen
        if chosen is None or not trainer.is_global_zero:
            return chosen
        start = read_start_checkpoint(chosen)
        continue_wandb_run(trainer, saved_wandb_id(start))  # before Lightning starts the wandb run
        for console in (cb for cb in trainer.callbacks if isinstance(cb, MiniMindConsole)):
            console.continue_logs(trainer, start)  # the checkpoint's CSV log directory
        self._start = (chosen, start)
        return chosen

    def restores_every_weight(self, trainer: L.Trainer, pl_module: L.LightningModule) -> bool:
        """Whether the start :meth:`choose` chose overwrites every weight of ``pl_module`` and this rank's random
        generators, so that the model's random initialisation may be skipped: a checkpoint, loaded strictly (not
        LoRA's adapters alone), that holds this rank's RNG state (on global rank 0, which read it: ours, not an
        original MiniMind file; another rank reseeds its generators at setup anyway)."""
        if self._chosen_here is None or not pl_module.strict_loading:
            return False
        if not trainer.is_global_zero:
            return True
        ckpt = self._start[1] if self._start is not None else {}
        return rank_rng_state(ckpt.get(TRAINING_STATE_KEY) or {}, 0) is not None

    def last_checkpoints(self, trainer: L.Trainer) -> set[str]:
        """What ``ckpt_path="last"`` means with this callback (:meth:`choose`; how Lightning asks: AnswersLast)."""
        if trainer.state.fn != TrainerFn.FITTING:  # validate/test(ckpt_path="last"): the newest valid file
            found = choose_with_remote("last", None, self.files.ckpt_dir, self.stem(trainer.lightning_module), 0)
            return {found} if found else set()
        chosen = self.choose(trainer, trainer.lightning_module, "last")
        if chosen is None:
            warnings.filterwarnings("ignore", message=NO_LAST_WARNING)  # said already, in this run's words
            return set()
        if not Path(chosen).exists():  # another rank, rank 0 downloads from the remote: rank 0's file is loaded
            self.files.ckpt_dir.mkdir(parents=True, exist_ok=True)
            return {str(self.files.ckpt_dir)}  # a stand-in Lightning sees exist; setup redirects the read
        return {chosen}

    def resume_from(self, path: str | None) -> None:
        """This rank's checkpoint choice, made elsewhere (at setup every rank agrees on global rank 0's)."""
        self._chosen_here = path

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        before_lightning_handlers(STOP)
        io = self._install_checkpoint_io(trainer)
        if stage != TrainerFn.FITTING:
            return
        check_at_setup(trainer, pl_module, self)  # every directory the run writes, before anything is made (preflight)
        if trainer.is_global_zero and self.remote is not None:
            self.remote.uploader.start()
        chosen = agree_on_checkpoint(trainer, self._chosen_here)  # a collective under DDP, before restore
        self._chosen_here = None
        if trainer.world_size > 1:  # one run id, so every rank names the checkpoint (and its shard) as rank 0 does
            self.run_id = trainer.strategy.broadcast(self.run_id, src=0)
        start, self._start = self._start, None
        if start is not None:
            io.hand_over(*start)  # Lightning's restore reads no file again
        elif chosen is not None and not trainer.is_global_zero:
            io.load_verified(chosen)  # rank 0's file; rank 0 checked its bytes

    def _install_checkpoint_io(self, trainer: L.Trainer) -> SafeCheckpointIO:
        """The strategy's checkpoint storage becomes :class:`SafeCheckpointIO` (its public setter) unless it
        is one already; another storage plugin of the user's is refused (its files would not be MiniMind's)."""
        io = trainer.strategy.checkpoint_io
        if type(io) is TorchCheckpointIO:  # Lightning's default: nothing of the user's is replaced
            io = trainer.strategy.checkpoint_io = SafeCheckpointIO()
        if not isinstance(io, SafeCheckpointIO):
            raise CheckpointError(f"ResumeCallback writes its checkpoints through lit_minimind.resume.io.SafeCheckpointIO "
                                  f"(atomic, verified, MiniMind's files), but the Trainer has {type(io).__name__} as its "
                                  "checkpoint plugin: remove it from Trainer(plugins=...)")
        io.async_writes = self.async_save
        io.datamodule_type = type(trainer.datamodule) if trainer.datamodule is not None else None
        return io

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        after_lightning_handlers(STOP)  # ours replaces Lightning's: a signal now waits for the optimizer step
        self.schedule.saved()
        if self.resumed_from is not None:
            self.resume_records.update(resume_record(trainer, self.resumed_from))
        self.wandb_id = describe_wandb_run(trainer, self.resume_records) or self.wandb_id
        rng, self._pending_rng = self._pending_rng, None
        if rng is not None:
            set_rng_state(rng)
        if STOP.agreed(trainer):  # a signal during start-up: nothing trained since the checkpoint
            self._stop(trainer, "before the first batch; nothing new to save")

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Weights are restored: a kill between a checkpoint and its MiniMind files left them behind,
        write them again (here, because a resume with nothing left to train never starts training)."""
        ckpt = Path(trainer.ckpt_path) if trainer.ckpt_path else None
        if ckpt is None or self.resumed_from is None or not trainer.is_global_zero:
            return
        stem = self.stem(pl_module)
        if ckpt.suffix == ".ckpt" and ckpt.parent == self.files.ckpt_dir and not self.files.published(ckpt, stem):
            self.saved_files = self.files.publish(ckpt, stem, fp16_weights(pl_module.state_dict()))
        if self.remote is not None and ckpt.parent == self.files.ckpt_dir:  # a local checkpoint newer than the remote's
            self.remote.offer_if_newer(ckpt, self.files.export(stem), stem, self.run_id)

    # ------------------------------------------------------------------ saving
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        """Saves are taken at optimizer-step boundaries only (a save never holds a half-accumulated
        gradient): one that falls due inside a window (``save_interval``, a new best, a ``max_time`` stop)
        is taken once that window's optimizer step is done."""
        step, iters = batch_idx + 1, int(trainer.num_training_batches)
        stepped = window_complete(step, iters, trainer.accumulate_grad_batches)
        stop = self._agree(trainer, stepped)
        self._save_due = self._save_due or self.schedule.by_step(step, iters)
        if not stepped:
            self._end.hold(trainer)  # a max_time stop (Lightning's Timer) inside a window: at its optimizer step
            return
        self._end.release(trainer)
        if self._best_due:
            self._save_best(trainer, pl_module)
        ends = trainer.should_stop or 0 < trainer.max_steps <= trainer.global_step
        if step < iters and (self._save_due or stop or ends or self.schedule.by_time(trainer)):
            self.save(trainer, pl_module)  # (an epoch's last batch is saved at the epoch's end)
        if stop:
            self._stop(trainer, f"after epoch {trainer.current_epoch + 1} step {step}/{iters}; checkpoint saved")

    def _agree(self, trainer: L.Trainer, stepped: bool) -> bool:
        """Whether to stop for a signal; raises when a background write failed on rank 0. Ranks agree
        at optimizer steps only (one small all-reduce there; nothing per micro-batch)."""
        failed = self._io_failed(trainer)
        if trainer.world_size == 1:
            if failed:
                self._raise_write_error(trainer)
            return stepped and STOP.requested
        if not stepped:
            return False
        flags = torch.tensor([float(STOP.requested), float(failed)], device=trainer.strategy.root_device)
        stop, failed_anywhere = (trainer.strategy.reduce(flags, reduce_op="max") > 0).tolist()
        if failed_anywhere:
            self._raise_write_error(trainer)
        return bool(stop)

    @staticmethod
    def _io_failed(trainer: L.Trainer) -> bool:
        return bool(getattr(trainer.strategy.checkpoint_io, "failed", False))

    def _raise_write_error(self, trainer: L.Trainer) -> None:
        self._raise_if_failed(trainer, self._take_io_error(trainer), self._in_flight or "could not save a checkpoint")

    def _wait_for_writes(self, trainer: L.Trainer) -> None:
        wait = getattr(trainer.strategy.checkpoint_io, "wait", None)
        if wait is not None:
            wait()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """The end of training waits for the write in flight, reports it if it failed, and says how long
        the last save took (a stop signal's grace period must be longer: README, Grace periods)."""
        self._wait_for_writes(trainer)
        self._raise_if_failed(trainer, self._take_io_error(trainer), self._in_flight)
        blocked, total = self.save_seconds
        if total is not None:
            rank_zero_info(f"last save took {total:.2f} s until its files were committed (the training loop waited "
                           f"{blocked:.2f} s); a stop signal's grace period must cover it and the step before it")

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._wait_for_writes(trainer)  # what was saved before the error is complete on disk

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """The end of a fit (Lightning calls it on the normal path only): every write is on disk, and with a
        remote directory global rank 0 waits (``upload_timeout``) for the newest save's upload."""
        self._wait_for_writes(trainer)
        if stage == TrainerFn.FITTING and self.remote is not None and trainer.is_global_zero:
            self.remote_holds = self.remote.finish(self.upload_timeout)
            if not self.remote_holds:
                print(self.remote.behind_line(), file=sys.stderr, flush=True)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if batches_done(trainer) >= int(trainer.num_training_batches):
            self.save(trainer, pl_module)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """With a validation split: keep ``{stem}_best.ckpt``, the checkpoint with the lowest val loss."""
        val = trainer.callback_metrics.get("val_loss")
        if trainer.sanity_checking or val is None:
            return
        if self.best_val_loss is None or float(val) < self.best_val_loss:
            self.best_val_loss = float(val)
            step = batches_done(trainer)
            if window_complete(step, int(trainer.num_training_batches), trainer.accumulate_grad_batches):
                self._save_best(trainer, pl_module)
            else:
                self._best_due = True  # taken at this window's optimizer step (on_train_batch_end)

    def _save_best(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._best_due = False
        path = self.files.best(self.stem(pl_module))
        self._begin_save(trainer, f"could not save the best checkpoint {path}")
        trainer.save_checkpoint(path, weights_only=False)
        self._export = None
        self.best_model_path = str(path)  # ModelCheckpoint's name for it: trainer.validate(ckpt_path="best")
        rank_zero_info(f"new best val_loss {self.best_val_loss:.4f}: saved {path}")

    def save(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Checkpoint (the commit record), then MiniMind's ``_resume.pth`` link and fp16 export; with
        ``async_save`` the loop waits only for the snapshot, the files are written in the background."""
        epoch, step = trainer.current_epoch, batches_done(trainer)
        self._save_due = False
        if self._last_saved == (epoch, step):
            return
        self.wandb_id = wandb_run_id(trainer) or self.wandb_id
        stem = self.stem(pl_module)
        path = self.files.checkpoint(CheckpointName(stem, epoch, step, trainer.global_step, self.run_id))
        started = time.monotonic()
        self._begin_save(trainer, f"could not save the checkpoint at epoch {epoch + 1} step {step} ({path}, "
                         f"then {self.files.resume(stem)} and {self.files.export(stem)}); the files of earlier saves "
                         "are unchanged and --ckpt_path last picks the newest complete checkpoint")
        with self.remote.uploader.paused() if self.remote is not None else contextlib.nullcontext():  # the snapshot first
            trainer.save_checkpoint(path, weights_only=False)
        io, export = trainer.strategy.checkpoint_io, self._export
        self._export = None
        self.save_seconds = (time.monotonic() - started, None)  # (the loop's wait, until every file is written)
        if trainer.is_global_zero:
            def publish() -> None:
                self.saved_files = self.files.publish(path, stem, export)
                self.files.prune(stem, self.run_id)
                if self.remote is not None:  # mirrored in the background once committed here
                    self.remote.offer(path, self.files.export(stem), stem, self.run_id)
                self.save_seconds = (self.save_seconds[0], time.monotonic() - started)
            io.submit(publish)  # after the checkpoint's commit; skipped if that failed (setup installed io)
        if not self.async_save:
            self._raise_if_failed(trainer, self._take_io_error(trainer), self._in_flight)
        self.schedule.saved(time.monotonic() - started)  # the loop's whole wait for this save (the auto interval's cost)
        self._last_saved = (epoch, step)
        self.last_model_path = str(path)

    def _begin_save(self, trainer: L.Trainer, what: str) -> None:
        """At most one save in flight: wait for the previous one, and stop if it failed."""
        self._wait_for_writes(trainer)
        self._raise_if_failed(trainer, self._take_io_error(trainer), self._in_flight)
        self._in_flight = what

    @staticmethod
    def _take_io_error(trainer: L.Trainer) -> OSError | None:
        take = getattr(trainer.strategy.checkpoint_io, "take_error", None)
        return take() if take is not None else None

    @staticmethod
    def _raise_if_failed(trainer: L.Trainer, error: OSError | None, what: str) -> None:
        """Never train on without checkpoints: rank 0's write error stops every rank."""
        message = trainer.strategy.broadcast(str(error) if error else None, src=0)
        if message:
            raise CheckpointError(f"{what}: {message}. Training stopped (free space or fix permissions, then "
                                  "resume with --ckpt_path last)")

    def _stop(self, trainer: L.Trainer, what: str) -> None:
        self.stopped_by = STOP.signal_name or "a signal on another rank"
        trainer.should_stop = True
        trainer.limit_val_batches = 0  # no validation in a preemption's grace period
        rank_zero_info(f"stopped by {self.stopped_by} {what}. Resume with the same command plus --ckpt_path last")

