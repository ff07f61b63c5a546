"""ResumeCallback: the adapter from Lightning's hooks to the run's
:class:`lit_minimind.resume.manager.CheckpointManager` (parts, one save, one load, retention, events). What is
here is *when*: a save due (:class:`lit_minimind.callbacks.schedule.SaveSchedule`) is taken at the next
optimizer step, a stop signal (:data:`lit_minimind.callbacks.preemption.STOP`) too."""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info

from lit_minimind.callbacks.preemption import STOP
from lit_minimind.callbacks.preflight import check_at_setup
from lit_minimind.callbacks.schedule import SaveSchedule
from lit_minimind.checkpoint.names import RESUME_STATE_KEY
from lit_minimind.resume.internals import (
    AnswersLast,
    DeferredStop,
    after_lightning_handlers,
    batches_done,
    before_lightning_handlers,
)
from lit_minimind.resume.manager import CheckpointManager
from lit_minimind.resume.states import window_complete


class ResumeCallback(AnswersLast):
    """Writes MiniMind's checkpoint files and makes every resume exact; alone in a Trainer it is enough.

    ``trainer.fit(..., ckpt_path="last")`` resumes from the newest valid checkpoint of ``ckpt_dir`` and continues its
    wandb run and CSV log directory (none: a fresh start, said). Global rank 0 saves every ``save_interval`` batches
    of an epoch and at its end (MiniMind's ``step % save_interval == 0 or step == iters``), at the optimizer step
    after a stop signal, and where training stops: the files of :mod:`lit_minimind.resume.manager`.

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
        upload_timeout: with a remote ``ckpt_dir``/``out_dir`` (an fsspec URL, :mod:`lit_minimind.resume.remote`): how
            many seconds the end of the run waits for the newest save's upload.
    """

    def __init__(self, save_interval: int = 1000, out_dir: str = "out", ckpt_dir: str = "checkpoints",
                 weight: str = "pretrain", keep_last: int = 2, save_every_minutes: float | str | None = None,
                 async_save: bool = True, upload_timeout: float = 300.0, keep_runs: int | None = None,
                 mtbf: float | None = None) -> None:
        self.schedule = SaveSchedule(save_interval, save_every_minutes, mtbf)
        self.manager = CheckpointManager(ckpt_dir, out_dir, weight, keep_last, keep_runs, async_save, upload_timeout)
        self.manager.register("schedule", self.schedule)  # the run's seconds and starts (its MTBF), save costs
        super().__init__(str(self.manager.files.ckpt_dir))
        self.stopped_by: str | None = None
        self._save_due = self._best_due = False  # due inside an accumulation window: taken at its optimizer step
        self._end = DeferredStop()  # likewise for a max_time stop

    @property
    def state_key(self) -> str:
        return RESUME_STATE_KEY

    # the --resume.* flags, as this callback uses them
    save_interval = property(lambda self: self.schedule.save_interval)
    ckpt_dir = property(lambda self: self.manager.files.ckpt_dir)
    out_dir = property(lambda self: self.manager.files.out_dir)
    weight = property(lambda self: self.manager.files.weight)

    def state_dict(self) -> dict[str, Any]:
        return self.manager.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.manager.load_state_dict(state_dict)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        self.manager.collect(trainer, checkpoint, batches_done(trainer))

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        self.manager.restore(trainer, checkpoint)

    # ------------------------------------------------------------------ start
    def choose(self, trainer: L.Trainer, pl_module: L.LightningModule, ckpt_path: str | None,
               datamodule: L.LightningDataModule | None = None) -> str | None:
        """The start (``"last"``: this run's newest; a file; None), read once and its loggers continued before fit starts
        them: ``ckpt_path="last"`` calls it; call it and pass its result to continue those of a file named by path."""
        return self.manager.choose(trainer, pl_module, ckpt_path, datamodule)

    def last_checkpoints(self, trainer: L.Trainer) -> set[str]:
        return self.manager.last(trainer)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        before_lightning_handlers(STOP)
        io = self.manager.install_io(trainer)
        if stage == TrainerFn.FITTING:
            check_at_setup(trainer, pl_module, self.manager)  # every directory the run writes, before anything is made
            self.manager.prepare(trainer, io)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.manager.republish(trainer, pl_module)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        after_lightning_handlers(STOP)  # ours replaces Lightning's: a signal now waits for the optimizer step
        self.schedule.saved()
        self.manager.train_start(trainer)
        if STOP.agreed(trainer):  # a signal during start-up: nothing trained since the checkpoint
            self._stop(trainer, "before the first batch; nothing new to save")

    # ------------------------------------------------------------------ when to save
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        """Saves are taken at optimizer-step boundaries only (a save never holds a half-accumulated gradient): one
        due inside a window (``save_interval``, a new best, a ``max_time`` stop) is taken at its optimizer step."""
        step, iters = batch_idx + 1, int(trainer.num_training_batches)
        stepped = window_complete(step, iters, trainer.accumulate_grad_batches)
        stop = self.manager.agree(trainer, stepped, STOP.requested)
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

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if batches_done(trainer) >= int(trainer.num_training_batches):
            self.save(trainer, pl_module)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """With a validation split: keep ``{stem}_best.ckpt``, the checkpoint with the lowest val loss."""
        val, best = trainer.callback_metrics.get("val_loss"), self.manager.best
        if trainer.sanity_checking or val is None or (best.value is not None and float(val) >= best.value):
            return
        best.value = float(val)
        if window_complete(batches_done(trainer), int(trainer.num_training_batches), trainer.accumulate_grad_batches):
            self._save_best(trainer, pl_module)
        else:
            self._best_due = True  # taken at this window's optimizer step (on_train_batch_end)

    def _save_best(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._best_due = False
        self.best_model_path = self.manager.save_best(trainer, pl_module)  # trainer.validate(ckpt_path="best")

    def save(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._save_due = False
        waited = self.manager.save(trainer, pl_module, batches_done(trainer))
        if waited is not None:
            self.schedule.saved(waited)  # the loop's whole wait for this save (the auto interval's cost)
            self.last_model_path = self.manager.last_path

    def _stop(self, trainer: L.Trainer, what: str) -> None:
        self.stopped_by = STOP.signal_name or "a signal on another rank"
        trainer.should_stop = True
        trainer.limit_val_batches = 0  # no validation in a preemption's grace period
        again = "" if self.manager.asked == "last" else " plus --ckpt_path last"  # (MiniMind's --from_resume 1 is last)
        rank_zero_info(f"stopped by {self.stopped_by} {what}. Resume with the same command{again}")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.manager.finish(trainer)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self.manager.wait(trainer)  # what was saved before the error is complete on disk

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.manager.teardown(trainer, stage)
