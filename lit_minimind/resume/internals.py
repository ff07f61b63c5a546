"""Lightning's internals, in one place: each thing this project knows about Lightning that Lightning does
not offer as public API, why it is needed, and what it relies on. Checked against Lightning 2.5.0
(``make test-compat``) and 2.6.6 (``make test``); a new Lightning release is checked here first.

1. :func:`batches_done`: the batches of the current epoch training has consumed (the loop's progress counter).
2. :func:`adopt_data_state`, :func:`adopt_scaler_state`: where Lightning keeps the DataModule's and the precision
   plugin's state (their classes' ``__qualname__``).
3. :func:`loops_at`: the loop counters of a position Lightning did not save (the loops' ``state_dict`` schema).
4. :class:`DeferredStop`: a ``trainer.should_stop`` (Lightning's ``Timer``) held to the optimizer step.
5. :func:`before_lightning_handlers` / :func:`after_lightning_handlers`: the SIGTERM handler handover.
6. :class:`AnswersLast`: how ``ckpt_path="last"`` reaches a callback (``ModelCheckpoint._find_last_checkpoints``).
7. :data:`NOISE_LINES`, :data:`NOISE_WARNINGS`, :data:`NO_LAST_WARNING`: Lightning's message texts that are filtered.
8. :class:`MiniMindSummary`: ``ModelSummary.summarize``'s signature.
9. :func:`csv_logger_args`: a ``CSVLogger``'s constructor arguments, kept in its private attributes.
10. :func:`launched_ranks`: the other DDP ranks this process launched (Lightning's launcher's ``procs``).

``tests/test_loop_state.py`` compares (3) with states Lightning saves itself; the rest is exercised by the
resume, console and signal tests of both Lightning versions.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Mapping
from typing import Any

from lightning.pytorch.callbacks import Callback, ModelCheckpoint, ModelSummary

from lit_minimind.resume.states import DataPosition, optimizer_steps, window_complete

CHECKED_WITH = ("2.5.0", "2.6.6")  # the Lightning versions every use below was checked against


# ----------------------------------------------------------------------------- 1. the epoch's progress

def batches_done(trainer: Any) -> int:
    """Batches of the current epoch training has consumed: ``fit_loop.epoch_loop.batch_progress.current.processed``.
    Lightning has no public counter of it (``global_step`` counts optimizer steps, a loader's own count runs
    ahead by its prefetch): it is MiniMind's ``step``, the data position of every save."""
    return int(trainer.fit_loop.epoch_loop.batch_progress.current.processed)


# ----------------------------------------------------------------------------- 2. the DataModule's state key

# Where Lightning saves and restores a DataModule's ``state_dict``: the top-level checkpoint key
# ``type(datamodule).__qualname__`` (``_CheckpointConnector.dump_checkpoint`` / ``restore_datamodule``).

def adopt_data_state(checkpoint: dict[str, Any], datamodule_type: type | None) -> None:
    """Before Lightning restores the DataModule (of ``datamodule_type``): when ``checkpoint`` holds no state
    under its key but under one of its base classes' (a MiniMind file converted for ``MiniMindDataModule``, a
    run before the user subclassed it), move that state to the live key, so that a user's subclass resumes
    the position too."""
    if datamodule_type is None:
        return
    key = datamodule_type.__qualname__
    if key in checkpoint:
        return
    for base in datamodule_type.__mro__[1:]:
        if base.__qualname__ in checkpoint and isinstance(checkpoint[base.__qualname__], Mapping):
            checkpoint[key] = checkpoint.pop(base.__qualname__)
            return


def adopt_scaler_state(checkpoint: dict[str, Any], plugin: Any) -> None:
    """Before Lightning restores the precision plugin: when ``plugin`` has a scaler and ``checkpoint``
    holds no state under its class name, give it the saved scaler state (MiniMind's ``scaler`` key,
    which every lit-minimind checkpoint carries), for Lightning to load with ``plugin.load_state_dict``. Lightning
    keeps a precision plugin's state under ``type(plugin).__qualname__`` (``_CheckpointConnector.dump_checkpoint``
    / ``restore_precision_plugin_state``)."""
    key = type(plugin).__qualname__
    saved = checkpoint.get("scaler")
    if saved and key not in checkpoint and getattr(plugin, "scaler", None) is not None:
        checkpoint[key] = dict(saved)


# ----------------------------------------------------------------------------- 3. loop counters

def fit_loop_state_at(template: dict[str, Any], position: DataPosition, accumulate: int, global_step: int) -> dict[str, Any]:
    """Fit-loop state as Lightning saves it after ``position`` (at least one batch trained).

    Lightning has no API to set a loop position: these are the counters its fit loop saves
    (``epoch_loop.batch_progress``, ``_batches_that_stepped``, the automatic optimization's
    ``optim_progress``, ``epoch_progress``). Inside an epoch: the state of a save in ``on_train_batch_end``
    of batch ``position.step``; a complete epoch: the state of a save in ``on_train_epoch_end``.
    ``template`` is a fresh ``trainer.fit_loop.state_dict()``, ``global_step`` the optimizer steps taken so far.
    """
    epoch, step, iters = position.epoch, position.step, position.iters
    if step < 1:
        raise ValueError("fit_loop_state_at needs a position after at least one batch")
    state = copy.deepcopy(template)
    end = position.epoch_complete
    stepped = window_complete(step, iters, accumulate)
    steps_in_epoch = optimizer_steps(DataPosition(0, step, iters), accumulate)
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


# ----------------------------------------------------------------------------- 4. a stop held to the optimizer step

class DeferredStop:
    """Lightning's ``Timer`` (``max_time``) sets ``trainer.should_stop`` in its ``on_train_batch_end``, and the
    loop stops after that batch, inside an accumulation window too. Saves are taken at optimizer steps only,
    so a stop inside a window is held (``should_stop`` cleared) and given back at the window's optimizer step."""

    def __init__(self) -> None:
        self.due = False

    def hold(self, trainer: Any) -> None:
        """Inside a window: a stop Lightning asked for waits for the optimizer step."""
        if trainer.should_stop:
            trainer.should_stop, self.due = False, True

    def release(self, trainer: Any) -> None:
        """At the optimizer step: the held stop takes effect."""
        if self.due:
            trainer.should_stop, self.due = True, False


# ----------------------------------------------------------------------------- 5. the SIGTERM handler handover

def before_lightning_handlers(stop: Any) -> None:
    """At a callback's ``setup``: Lightning registers its own SIGTERM handler later, in ``Trainer._run``
    after ``on_fit_start`` (``_SignalConnector.register_signal_handlers``), and calls the handler it finds
    installed from its own: install ours (``stop``: :class:`lit_minimind.callbacks.preemption.StopRequest`) first."""
    stop.install()


def after_lightning_handlers(stop: Any) -> None:
    """At ``on_train_start``: Lightning's handler is registered now (it raises ``SIGTERMException`` at the end
    of a batch, mid accumulation window, and broadcasts inside the handler under DDP): ours replaces it, and
    SIGTERM, held away from every Python handler since start-up (``StopRequest.hold_sigterm``), reaches it."""
    stop.install()
    stop.release_sigterm()


# ----------------------------------------------------------------------------- 6. how ckpt_path="last" reaches us

class AnswersLast(ModelCheckpoint):
    """A ``ModelCheckpoint`` only so that Lightning asks it what ``ckpt_path="last"`` means: Lightning resolves
    ``"last"`` before any hook runs (``_CheckpointConnector._parse_ckpt_path``), asking only each
    ``ModelCheckpoint``'s ``_find_last_checkpoints`` (and ``OnExceptionCheckpoint.ckpt_path``, which would
    also turn ``ckpt_path=None`` into a resume). The answer is :meth:`last_checkpoints`. None of
    ``ModelCheckpoint``'s own saving or state runs: each hook it defines is a plain ``Callback``'s here."""

    setup = Callback.setup
    on_train_start = Callback.on_train_start
    on_train_batch_end = Callback.on_train_batch_end
    on_train_epoch_end = Callback.on_train_epoch_end
    on_validation_end = Callback.on_validation_end
    on_exception = Callback.on_exception
    on_train_end = Callback.on_train_end
    state_dict = Callback.state_dict
    load_state_dict = Callback.load_state_dict

    def __init__(self, dirpath: str) -> None:
        super().__init__(dirpath=dirpath, save_top_k=0, save_last=False)

    def last_checkpoints(self, trainer: Any) -> set[str]:
        """The files ``ckpt_path="last"`` may mean (Lightning takes the newest by modification time)."""
        return set()

    def _find_last_checkpoints(self, trainer: Any) -> set[str]:
        return self.last_checkpoints(trainer)


# ----------------------------------------------------------------------------- 7. Lightning's message texts

# rank_zero_info's (lightning.pytorch's and lightning.fabric's) and the model summary's loggers
NOISY_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero",
                 "lightning.pytorch.callbacks.model_summary")
NOISE_LINES = (
    re.compile(r"💡 Tip: "),  # litlogger / litmodels advertisements
    re.compile(r"(?:GPU|TPU|HPU|IPU) available: "),  # what the accelerator flags already say
    re.compile(r"Trainer already configured with model summary callbacks"),  # ours: MiniMindSummary
)
# the summary's "0         Total Flops" (Lightning counts FLOPs only with an example input)
NO_FLOPS = re.compile(r"^(?:0\s+Total Flops|Total Flops:?\s+0)[ \t]*(?:\n|$)", re.M | re.I)
NOISE_WARNINGS = (
    r"Precision \S+ is not supported by the model summary",  # its size estimate: 32 bits, right for mixed
    r"Starting from v1\.9\.0, `tensorboardX` has been removed",  # logger=True: the CSV logger, as wanted
    r"The number of training batches \(\d+\) is smaller than the logging interval",  # MiniMindConsole logs every batch
    r".*isinstance\(treespec, LeafSpec\)",  # Lightning 2.6's use of a torch API torch 2.13 deprecates
    # DDP: LitMiniMind logs torchmetrics means, already reduced across ranks by compute()
    r"It is recommended to use `self\.log\('(?:mean_loss|val_loss|val_perplexity)', \.\.\., sync_dist=True\)`",
)
# Lightning's own line when ``ckpt_path="last"`` finds nothing (ResumeCallback says it once, in its own words)
NO_LAST_WARNING = r'.*ckpt_path="last"\) is set, but there is no last checkpoint available.*'


# ----------------------------------------------------------------------------- 8. the model summary's table

class MiniMindSummary(ModelSummary):
    """Lightning's model summary as text (through its logger, like its other lines), without the FLOPs
    column when nothing was counted (Lightning counts FLOPs only with an ``example_input_array``).
    ``ModelSummary.summarize`` is a static method whose arguments are Lightning's table columns."""

    @staticmethod
    def summarize(summary_data: list[tuple[str, list[str]]], total_parameters: int, trainable_parameters: int,
                  model_size: float, total_training_modes: dict[str, int], total_flops: int, **kwargs: Any) -> None:
        if not total_flops:
            summary_data = [(name, column) for name, column in summary_data if name != "FLOPs"]
        ModelSummary.summarize(summary_data, total_parameters, trainable_parameters, model_size, total_training_modes,
                               total_flops=total_flops, **kwargs)


# ----------------------------------------------------------------------------- 9. a CSVLogger built again

def csv_logger_args(logger: Any) -> dict[str, Any]:
    """A CSVLogger's constructor arguments, to build it again with another ``version`` before it started.

    CSVLogger keeps its ``version`` (None until it is chosen), ``prefix`` and flush interval only in private
    attributes (``_version``, ``_prefix``, ``_flush_logs_every_n_steps``) and has no public way to set a version."""
    return {"save_dir": logger.save_dir, "name": logger.name, "version": getattr(logger, "_version", None),
            "prefix": getattr(logger, "_prefix", ""),
            "flush_logs_every_n_steps": getattr(logger, "_flush_logs_every_n_steps", 100)}


# ----------------------------------------------------------------------------- 10. the ranks this process launched

def launched_ranks(trainer: Any) -> tuple[Any, list[Any]]:
    """``(launcher, its live child processes)``: the other DDP ranks of this node that Lightning's launcher
    started as children of this process (``_SubprocessScriptLauncher.procs``, ``subprocess.Popen`` objects; empty
    under torchrun, SLURM or a spawn launcher, whose ranks are not this process's children). The launcher's public
    ``kill(signum)`` signals them."""
    launcher = getattr(trainer.strategy, "launcher", None)
    procs = [p for p in getattr(launcher, "procs", None) or [] if p.poll() is None]
    return launcher, procs

