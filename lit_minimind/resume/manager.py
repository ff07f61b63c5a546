"""CheckpointManager: the one owner of a run's checkpoint lifecycle, as torchtitan's checkpoint manager is,
inside Lightning's hooks (:class:`lit_minimind.callbacks.ResumeCallback` is the thin adapter that calls it).

* **Named parts.** Every piece of state the run keeps beyond Lightning's own (module, optimizer, loops, the
  DataModule's position, the precision plugin's scaler: Lightning saves those) is a part with
  ``state_dict``/``load_state_dict``, registered under its name: ``run_id``, ``wandb_id``
  (:class:`lit_minimind.resume.states.WandbRun`), ``best_val_loss``, ``resume_records``, ``format``,
  ``versions``, and ``schedule`` (the adapter's :class:`lit_minimind.callbacks.schedule.SaveSchedule`).
  Lightning saves them as the callback's state; each rank's RNG and MiniMind's keys go beside them
  (:meth:`CheckpointManager.collect`). A new kind of state is one class and one :meth:`register`: PPO's critic
  and its optimizer, e.g., would be ``manager.register("critic", CriticState(critic, optimizer))``.
* **One save** (:meth:`CheckpointManager.save`): Lightning's checkpoint (the commit record), then MiniMind's
  ``_resume.pth`` link and fp16 export, then retention (:class:`CheckpointFiles`), then the remote's upload;
  at most one save in flight, a failed write stopping every rank.
* **One load**: :meth:`CheckpointManager.choose` (the start chosen once: :class:`lit_minimind.resume.start.Start`)
  and :meth:`CheckpointManager.restore` (after Lightning's restore). They import :mod:`lit_minimind.resume.start`
  when called: a save never loads the reader; a URL directory imports :mod:`lit_minimind.resume.remote`.
* **Events**: a callback with ``on_checkpoint_chosen(trainer, start)`` or ``on_checkpoint_saved(trainer, path)``
  hears of the start (before the loggers start) and of each save (once its snapshot is taken): the console
  continues its CSV log directory and writes the save ledger from them, and is not reached into.

A run's files, in this order, by global rank 0: ``{ckpt_dir}/{stem}_e{epoch}_s{step}_g{global_step}_{run_id}.ckpt``
(Lightning's checkpoint, also MiniMind's resume dict), ``{ckpt_dir}/{stem}_resume.pth`` (a hard link to it),
``{out_dir}/{stem}.pth`` (fp16 weights); ``stem`` is ``{weight}_{hidden}{_moe}``. Several runs may share one
checkpoint directory: each save carries its run's id (in its name and manifest, kept across resumes);
``keep_last`` is per run and never prunes another run's files; ``keep_runs N`` bounds the runs (at a run's
first save the checkpoints of all but the newest ``N`` runs are deleted: :func:`lit_minimind.checkpoint.atomic.retain_runs`).
"""

from __future__ import annotations

import contextlib
import copy
import sys
import time
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info

from lit_minimind.checkpoint.atomic import FileOps, LocalDir, read_manifest, retain, retain_runs
from lit_minimind.checkpoint.names import (
    CALLBACK_FORMAT_VERSION,
    RESUME_STATE_KEY,
    TRAINING_STATE_KEY,
    CheckpointName,
    checkpoint_stem,
    is_url,
    minimind_file_names,
)
from lit_minimind.checkpoint.weights import add_minimind_keys, fp16_weights, unwrap_model
from lit_minimind.errors import CheckpointError, say
from lit_minimind.resume.io import SafeCheckpointIO, saved_wandb_id
from lit_minimind.resume.states import (
    WandbRun,
    library_versions,
    resume_record,
    save_rank_states,
    set_rng_state,
    window_complete,
)

# ----------------------------------------------------------------------------- parts

class Stateful(Protocol):
    """What a part is: its state for the checkpoint, and taking it back."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


class Value:
    """A part that is one plain value (the run id, the best validation loss, ...). ``keep``: a checkpoint
    without it (missing, empty) leaves the value as it is."""

    def __init__(self, value: Any = None, keep: bool = False) -> None:
        self.value, self.keep = value, keep

    def state_dict(self) -> Any:
        return copy.copy(self.value)

    def load_state_dict(self, state: Any) -> None:
        if state or not self.keep:
            self.value = copy.copy(state)


class Versions:
    """A part: the library versions the checkpoint was written with; a resume under another torch or Lightning
    says it may not be bit-exact."""

    def state_dict(self) -> dict[str, str]:
        return library_versions()

    def load_state_dict(self, state: dict[str, str] | None) -> None:
        here = library_versions()
        for lib, version in (state or {}).items():
            if lib in ("torch", "lightning") and version != here[lib]:
                say(f"checkpoint was written with {lib} {version}, this run uses {here[lib]}: "
                               "resume may not be bit-exact")


class Constant(Value):
    """A part written with every checkpoint and never read back (the state's format number)."""

    def load_state_dict(self, state: Any) -> None:
        pass


def emit(trainer: Any, event: str, *args: Any) -> None:
    """Tell every callback that listens (``on_checkpoint_{event}(trainer, *args)``)."""
    for callback in trainer.callbacks:
        handler = getattr(callback, f"on_checkpoint_{event}", None)
        if callable(handler):
            handler(trainer, *args)


# ----------------------------------------------------------------------------- the files

class CheckpointFiles:
    """MiniMind's two names for a ``stem`` (``{weight}_{hidden}{_moe}``) plus our rolling window.

    * ``{ckpt_dir}/{stem}_e{epoch}_s{step}_g{global_step}_{run_id}.ckpt``: one per save (the
      Lightning checkpoint, also MiniMind's resume dict); the newest ``keep_last`` of this run stay;
      ``run_id`` keeps runs apart, so a fresh run never replaces or prunes another run's files, unless
      ``keep_runs`` is set: then only the newest ``keep_runs`` runs' files stay.
    * ``{ckpt_dir}/{stem}_resume.pth``: a hard link to the newest of them (MiniMind's name).
    * ``{out_dir}/{stem}.pth``: MiniMind's fp16 weight export, written after the checkpoint.

    Both directories are :class:`lit_minimind.checkpoint.atomic.LocalDir` storages, written through ``ops``.
    """

    def __init__(self, ckpt_dir: str | Path, out_dir: str | Path, weight: str, keep_last: int,
                 keep_runs: int | None = None, ops: FileOps | None = None) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        if keep_runs is not None and keep_runs < 1:
            raise ValueError(f"keep_runs must be >= 1 (or unset: every run's files stay), got {keep_runs}")
        self.ckpt, self.out = LocalDir(ckpt_dir, ops), LocalDir(out_dir, ops)
        self.weight, self.keep_last = weight, keep_last
        self.keep_runs, self._runs_pruned = keep_runs, False
        self._replaced: set[str] = set()  # other runs whose export this run replaced (said once each)

    @property
    def ckpt_dir(self) -> Path:
        return self.ckpt.root

    @property
    def out_dir(self) -> Path:
        return self.out.root

    def checkpoint(self, name: CheckpointName) -> Path:
        return self.ckpt_dir / str(name)

    def best(self, stem: str) -> Path:
        return self.ckpt_dir / f"{stem}_best.ckpt"

    def export(self, stem: str) -> Path:
        return self.out_dir / minimind_file_names(stem)[0]

    def resume(self, stem: str) -> Path:
        return self.ckpt_dir / minimind_file_names(stem)[1]

    def publish(self, checkpoint: Path, stem: str, weights: dict[str, torch.Tensor]) -> list[Path]:
        """After ``checkpoint`` is committed: MiniMind's ``_resume.pth`` (a link) and fp16 export (another run's
        export of the same name replaced: said, once)."""
        meta = {k: v for k, v in read_manifest(checkpoint).items() if k in ("epoch", "step", "global_step", "run_id")}
        other = read_manifest(self.export(stem)).get("run_id") if self.export(stem).exists() else None
        if other and other != meta.get("run_id") and other not in self._replaced:
            self._replaced.add(other)
            say(f"{self.export(stem)}: replacing the fp16 export of another run ({other}; MiniMind names the export by "
                f"{stem} only); that run's checkpoints stay in {self.ckpt_dir}/")
        self.ckpt.commit(self.resume(stem).name, checkpoint)
        self.out.save(weights, self.export(stem).name, {"kind": "weights", **meta})
        return [self.export(stem), self.resume(stem)]

    def prune(self, stem: str, run_id: str) -> None:
        """Keep the newest ``keep_last`` checkpoints of this run (never another run's files); with
        ``keep_runs``, at this process's first save, only the newest ``keep_runs`` runs' checkpoints."""
        retain(self.ckpt, CheckpointName.pattern(stem), run_id, self.keep_last)
        if self.keep_runs is not None and not self._runs_pruned:
            self._runs_pruned = True
            removed = retain_runs(self.ckpt, CheckpointName.pattern(stem), run_id, self.keep_runs)
            if removed:
                print(f"checkpoints: --resume.keep_runs {self.keep_runs}: removed {sum(map(len, removed.values()))} "
                      f"checkpoint(s) of {len(removed)} older run(s) ({', '.join(sorted(removed))}) from "
                      f"{self.ckpt_dir}/", flush=True)


# ----------------------------------------------------------------------------- the manager

def remote_directories(ckpt_dir: str, out_dir: str, keep_last: int) -> tuple[Any, str, str]:
    """``(remote, local ckpt_dir, local out_dir)``: URL directories are written to local staging directories,
    then uploaded (:mod:`lit_minimind.resume.remote`, imported only for them)."""
    if not (is_url(str(ckpt_dir)) or is_url(str(out_dir))):
        return None, ckpt_dir, out_dir
    from lit_minimind.resume.remote import RemoteCheckpoints, staging_dir

    return (RemoteCheckpoints.of(ckpt_dir, out_dir, keep_last), staging_dir("ckpt_dir", ckpt_dir),
            staging_dir("out_dir", out_dir))


class CheckpointManager:
    """A run's checkpoints: its parts, one save, one load (choose + restore), retention, events.

    Args: the ``--resume.*`` flags of :class:`lit_minimind.callbacks.ResumeCallback`, which documents them; ``ops``:
    the file operations every write of the run goes through (:class:`lit_minimind.checkpoint.atomic.FileOps`).
    """

    def __init__(self, ckpt_dir: str = "checkpoints", out_dir: str = "out", weight: str = "pretrain", keep_last: int = 2,
                 keep_runs: int | None = None, async_save: bool = True, upload_timeout: float = 300.0,
                 ops: FileOps | None = None) -> None:
        self.remote, ckpt_dir, out_dir = remote_directories(ckpt_dir, out_dir, keep_last)
        if upload_timeout < 0:
            raise ValueError(f"--resume.upload_timeout must be >= 0 seconds, got {upload_timeout}")
        self.files = CheckpointFiles(ckpt_dir, out_dir, weight, keep_last, keep_runs, ops)
        self.async_save, self.upload_timeout = async_save, upload_timeout
        self.run = Value(uuid.uuid4().hex[:8], keep=True)  # carried across resumes: a fresh run never touches another's files
        self.wandb = WandbRun()
        self.best = Value()  # the lowest validation loss so far (``{stem}_best.ckpt``)
        self.records = Value({}, keep=True)  # every resume of this run (for the wandb config)
        self.identity = Constant(None)  # this run's data, batch size, depth: `last` passes over other runs' files
        self.parts: dict[str, Stateful] = {}
        for name, part in (("run_id", self.run), ("wandb_id", self.wandb), ("best_val_loss", self.best),
                           ("resume_records", self.records), ("format", Constant(CALLBACK_FORMAT_VERSION)),
                           ("versions", Versions()), ("identity", self.identity)):
            self.register(name, part)
        self.start: Any = None  # the chosen start (lit_minimind.resume.start.Start), until setup hands it over
        self.asked: str | None = None  # the ckpt_path the run was started with ("last": a rerun resumes by itself)
        self.resumed_from: dict[str, Any] | None = None
        self.saved_files: list[Path] = []
        self.save_seconds: tuple[float, float | None] = (0.0, None)  # the last save: loop's wait, until committed
        self.last_path = ""  # the newest save's checkpoint
        self.remote_holds = True  # a remote directory holds the newest save (checked at the end of the fit)
        self._pending_rng: Any = None  # this rank's RNG state, set at train start
        self._export: dict[str, torch.Tensor] | None = None
        self._last_saved: tuple[int, int] | None = None
        self._in_flight = ""  # what the save being written is, for its error message

    def register(self, name: str, part: Stateful) -> None:
        """Add a part: its state is saved under ``name`` with every checkpoint, and given back on resume."""
        self.parts[name] = part

    def state_dict(self) -> dict[str, Any]:
        return {name: part.state_dict() for name, part in self.parts.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, part in self.parts.items():
            part.load_state_dict(state.get(name))

    def stem(self, pl_module: Any) -> str:
        cfg = unwrap_model(pl_module).config
        return checkpoint_stem(self.files.weight, cfg.hidden_size, cfg.use_moe)

    @staticmethod
    def identity_of(datamodule: Any, pl_module: Any) -> dict[str, Any]:
        """What tells this run's checkpoints from another run's under the same stem (the same ``{weight}_{hidden}``
        names): its data file (by name and size, so that a copy elsewhere, another machine's, is the same data;
        ``data``, its absolute path, is for the messages; None: the embedded corpus), batch size, held-out
        fraction and depth. Also in each checkpoint's manifest, so that ``last`` tells them apart without loading
        a file."""
        data = getattr(datamodule, "data_path", None)
        path = Path(data).resolve() if data else None
        return {"data": str(path) if path else None, "data_name": path.name if path else None,
                "data_bytes": path.stat().st_size if path is not None and path.is_file() else None,
                "batch_size": getattr(datamodule, "batch_size", None),
                "val_fraction": getattr(datamodule, "val_fraction", None),
                "layers": unwrap_model(pl_module).config.num_hidden_layers}

    # ------------------------------------------------------------------ set-up
    def install_io(self, trainer: Any) -> SafeCheckpointIO:
        """The strategy's checkpoint storage becomes :class:`SafeCheckpointIO` (its public setter) unless it
        is one already; another storage plugin of the user's is refused (its files would not be MiniMind's)."""
        io = trainer.strategy.checkpoint_io
        if type(io) is TorchCheckpointIO:  # Lightning's default: nothing of the user's is replaced
            io = trainer.strategy.checkpoint_io = SafeCheckpointIO(ops=self.files.ckpt.ops)
        if not isinstance(io, SafeCheckpointIO):
            raise CheckpointError(f"ResumeCallback writes its checkpoints through lit_minimind.resume.io.SafeCheckpointIO "
                                  f"(atomic, verified, MiniMind's files), but the Trainer has {type(io).__name__} as its "
                                  "checkpoint plugin: remove it from Trainer(plugins=...)")
        io.async_writes = self.async_save
        io.datamodule_type = type(trainer.datamodule) if trainer.datamodule is not None else None
        return io

    def prepare(self, trainer: Any, io: SafeCheckpointIO) -> None:
        """At setup, on every rank (collectives under DDP, before restore): global rank 0's start and run id
        for all; Lightning's restore takes rank 0's read, another rank reads rank 0's file."""
        from lit_minimind.resume.start import Start, agree_on_checkpoint

        if trainer.is_global_zero and self.remote is not None:
            self.remote.uploader.start()
        self.identity.value = self.identity_of(trainer.datamodule, trainer.lightning_module)
        start, self.start = self.start, None
        chosen = agree_on_checkpoint(trainer, start.path if start is not None else None)
        if trainer.world_size > 1:  # one run id, so every rank names the checkpoint (and its shard) as rank 0 does
            self.run.value = trainer.strategy.broadcast(self.run.value, src=0)
        if start is not None and start.ckpt is not None:
            io.start = start  # Lightning's restore takes the read already made: no file read again
        elif chosen is not None and not trainer.is_global_zero:
            io.start = Start(chosen, agreed=True)  # rank 0's file; rank 0 checked its bytes

    # ------------------------------------------------------------------ load
    def choose(self, trainer: Any, pl_module: Any, ckpt_path: str | None, datamodule: Any = None) -> str | None:
        """The start, before ``trainer.fit`` starts the loggers (:func:`lit_minimind.resume.start.choose`; ``last``: of
        this run's data and shape, :meth:`identity_of` ``datamodule``, the trainer's by default); on global rank 0 the
        wandb run continues and the ``chosen`` event carries the verified read."""
        from lit_minimind.resume.start import choose

        ours = self.identity_of(datamodule if datamodule is not None else trainer.datamodule, pl_module)
        self.start, self.asked = None, ckpt_path
        if trainer.is_global_zero and self.remote is not None:
            self.remote.uploader.start()  # the upload process starts up while the trainer does
        self.start = choose(ckpt_path, self.files, self.stem(pl_module), trainer.global_rank, self.remote, ours)
        if self.start is None or self.start.ckpt is None:
            return self.start.path if self.start is not None else None
        self.wandb.at_start(trainer, saved_wandb_id(self.start.ckpt))  # before Lightning starts the wandb run
        emit(trainer, "chosen", self.start)
        return self.start.path

    def last(self, trainer: Any) -> set[str]:
        """What ``ckpt_path="last"`` means: :meth:`choose` when fitting (none yet: a fresh start, said once); for
        ``validate``/``test`` the newest valid file."""
        from lit_minimind.resume.internals import NO_LAST_WARNING
        from lit_minimind.resume.start import choose_checkpoint

        if trainer.state.fn != TrainerFn.FITTING:
            found = choose_checkpoint("last", self.files.ckpt_dir, self.stem(trainer.lightning_module), 0)
            return {found} if found else set()
        chosen = self.choose(trainer, trainer.lightning_module, "last")
        if chosen is None:
            warnings.filterwarnings("ignore", message=NO_LAST_WARNING)  # said already, in this run's words
            return set()
        if not Path(chosen).exists():  # another rank, rank 0 downloads from the remote: rank 0's file is loaded
            self.files.ckpt_dir.mkdir(parents=True, exist_ok=True)
            return {str(self.files.ckpt_dir)}  # a stand-in Lightning sees exist; setup redirects the read
        return {chosen}

    def restores_every_weight(self, trainer: Any, pl_module: Any) -> bool:
        """Whether the chosen start overwrites every weight of ``pl_module`` and this rank's random generators, so
        that the model's random initialisation may be skipped: a checkpoint, loaded strictly (not LoRA's adapters
        alone), that holds this rank's RNG state (on global rank 0, which read it: ours, not an original MiniMind
        file; another rank reseeds its generators at setup anyway)."""
        if self.start is None or not pl_module.strict_loading:
            return False
        return not trainer.is_global_zero or self.start.restores_rng()

    def restore(self, trainer: Any, checkpoint: dict[str, Any]) -> None:
        """After Lightning's restore (``on_load_checkpoint``): :func:`lit_minimind.resume.start.restore`."""
        from lit_minimind.resume.start import restore

        resumed_from, rng = restore(trainer, checkpoint, RESUME_STATE_KEY)
        if resumed_from is not None:
            self.resumed_from, self._pending_rng = resumed_from, rng

    def train_start(self, trainer: Any) -> None:
        """Training starts: the resume recorded, the wandb run described, this rank's RNG restored."""
        if self.resumed_from is not None:
            self.records.value.update(resume_record(trainer, self.resumed_from))
        self.wandb.at_train_start(trainer, self.records.value)
        rng, self._pending_rng = self._pending_rng, None
        if rng is not None:
            set_rng_state(rng)

    def republish(self, trainer: Any, pl_module: Any) -> None:
        """Weights are restored: a kill between a checkpoint and its MiniMind files left them behind, write them
        again (at fit start: a resume with nothing left to train never starts training)."""
        from lit_minimind.resume.start import published

        ckpt = Path(trainer.ckpt_path) if trainer.ckpt_path else None
        if ckpt is None or self.resumed_from is None or not trainer.is_global_zero:
            return
        stem = self.stem(pl_module)
        if ckpt.suffix == ".ckpt" and ckpt.parent == self.files.ckpt_dir and not published(self.files, ckpt, stem):
            self.saved_files = self.files.publish(ckpt, stem, fp16_weights(pl_module.state_dict()))
        if self.remote is not None and ckpt.parent == self.files.ckpt_dir:  # a local checkpoint newer than the remote's
            self.remote.offer_if_newer(ckpt, self.files.export(stem), stem, self.run.value)

    # ------------------------------------------------------------------ save
    def collect(self, trainer: Any, checkpoint: dict[str, Any], step: int) -> None:
        """``on_save_checkpoint``: each rank's RNG (gathered to rank 0) and MiniMind's keys beside Lightning's.
        Saves are taken at optimizer-step boundaries, where no gradient is pending."""
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if not window_complete(step, int(trainer.num_training_batches), trainer.accumulate_grad_batches):
            say("a checkpoint saved inside an accumulation window (trainer.save_checkpoint outside "
                           "ResumeCallback) holds no partial gradients: its resume restarts the window's gradients")
        checkpoint[TRAINING_STATE_KEY] = save_rank_states(trainer)
        if trainer.is_global_zero:  # the rank that writes (DDP discards the others' dicts): no fp16 copy elsewhere
            self._export = add_minimind_keys(checkpoint, step=step, world_size=trainer.world_size, wandb_id=self.wandb.id,
                                             scaler_state=scaler.state_dict() if scaler is not None else None)

    def save(self, trainer: Any, pl_module: Any, step: int) -> float | None:
        """Checkpoint (the commit record), then MiniMind's ``_resume.pth`` link and fp16 export, retention and
        the remote's upload; with ``async_save`` the loop waits only for the snapshot, the files are written in
        the background. Returns the loop's wait in seconds (None: this position is saved already)."""
        epoch = trainer.current_epoch
        if self._last_saved == (epoch, step):
            return None
        self.wandb.at_save(trainer)
        stem = self.stem(pl_module)
        path = self.files.checkpoint(CheckpointName(stem, epoch, step, trainer.global_step, self.run.value))
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
                self.files.prune(stem, self.run.value)
                if self.remote is not None:  # mirrored in the background once committed here
                    self.remote.offer(path, self.files.export(stem), stem, self.run.value)
                self.save_seconds = (self.save_seconds[0], time.monotonic() - started)
            io.submit(publish)  # after the checkpoint's commit; skipped if that failed (setup installed io)
        if not self.async_save:
            self._raise_if_failed(trainer, self._take_io_error(trainer), self._in_flight)
        waited = time.monotonic() - started
        self._last_saved, self.last_path = (epoch, step), str(path)
        emit(trainer, "saved", str(path))
        return waited

    def save_best(self, trainer: Any, pl_module: Any) -> str:
        """``{stem}_best.ckpt``: the checkpoint with the lowest validation loss."""
        path = self.files.best(self.stem(pl_module))
        self._begin_save(trainer, f"could not save the best checkpoint {path}")
        trainer.save_checkpoint(path, weights_only=False)
        self._export = None
        rank_zero_info(f"new best val_loss {self.best.value:.4f}: saved {path}")
        return str(path)

    # ------------------------------------------------------------------ writes in flight, failures, the end
    def agree(self, trainer: Any, stepped: bool, requested: bool) -> bool:
        """Whether to stop for a signal (``requested`` here); raises when a background write failed on rank 0.
        Ranks agree at optimizer steps only (one small all-reduce there; nothing per micro-batch)."""
        failed = bool(getattr(trainer.strategy.checkpoint_io, "failed", False))
        if trainer.world_size == 1:
            stop = stepped and requested
        elif not stepped:
            return False
        else:
            flags = torch.tensor([float(requested), float(failed)], device=trainer.strategy.root_device)
            stop, failed = (trainer.strategy.reduce(flags, reduce_op="max") > 0).tolist()
        if failed:
            self._raise_if_failed(trainer, self._take_io_error(trainer), self._in_flight or "could not save a checkpoint")
        return bool(stop)

    def wait(self, trainer: Any) -> None:
        """Every write submitted is on disk."""
        wait = getattr(trainer.strategy.checkpoint_io, "wait", None)
        if wait is not None:
            wait()

    def finish(self, trainer: Any) -> None:
        """The end of training waits for the write in flight, reports it if it failed, and says how long the
        last save took (a stop signal's grace period must be longer: docs/several-machines.md, Grace periods)."""
        self.wait(trainer)
        self._raise_if_failed(trainer, self._take_io_error(trainer), self._in_flight)
        blocked, total = self.save_seconds
        if total is not None:
            rank_zero_info(f"last save took {total:.2f} s until its files were committed (the training loop waited "
                           f"{blocked:.2f} s); a stop signal's grace period must cover it and the step before it")

    def teardown(self, trainer: Any, stage: str) -> None:
        """The end of a fit (normal path only): every write is on disk, and with a remote directory global rank 0
        waits (``upload_timeout``) for the newest save's upload."""
        self.wait(trainer)
        if stage == TrainerFn.FITTING and self.remote is not None and trainer.is_global_zero:
            self.remote_holds = self.remote.finish(self.upload_timeout)
            if not self.remote_holds:
                print(self.remote.behind_line(), file=sys.stderr, flush=True)

    def _begin_save(self, trainer: Any, what: str) -> None:
        """At most one save in flight: wait for the previous one, and stop if it failed."""
        self.wait(trainer)
        self._raise_if_failed(trainer, self._take_io_error(trainer), self._in_flight)
        self._in_flight = what

    @staticmethod
    def _take_io_error(trainer: Any) -> OSError | None:
        take: Callable[[], OSError | None] | None = getattr(trainer.strategy.checkpoint_io, "take_error", None)
        return take() if take is not None else None

    @staticmethod
    def _raise_if_failed(trainer: Any, error: OSError | None, what: str) -> None:
        """Never train on without checkpoints: rank 0's write error stops every rank."""
        message = trainer.strategy.broadcast(str(error) if error else None, src=0)
        if message:
            raise CheckpointError(f"{what}: {message}. Training stopped (free space or fix permissions, then "
                                  "resume with --ckpt_path last)")
