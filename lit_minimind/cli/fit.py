"""``python -m lit_minimind.fit``: MiniMind pretraining on LightningCLI.

With no arguments it trains a small model on the embedded corpus on CPU. Every flag is
LightningCLI's (``--model.*``, ``--data.*``, ``--trainer.*``, ``--config``) plus
``--resume.*`` (:class:`lit_minimind.callbacks.ResumeCallback`), ``--log_interval`` and ``--ckpt_path``
(``last``, a Lightning ``.ckpt`` or a MiniMind ``_resume.pth``) and ``--from_weight``. MiniMind's own
``train_pretrain.py`` flags work too (:mod:`lit_minimind.cli.flags`). Run with ``--help``.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from jsonargparse import ArgumentError
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lit_minimind.callbacks import MiniMindConsole, ResumeCallback
from lit_minimind.callbacks.preemption import LOST_PEER_EXIT, STOP, cluster_plugins, lost_peer_advice, requeue_if_preempted
from lit_minimind.callbacks.preflight import check_run_dirs
from lit_minimind.callbacks.progress import MiniMindProgressBar, PlainProgress
from lit_minimind.callbacks.quiet import hide_harmless_noise
from lit_minimind.callbacks.watchdog import Watchdog
from lit_minimind.cli.export import export_after_fit
from lit_minimind.cli.flags import help_epilog, mapping_line, name_origins, translate
from lit_minimind.cli.from_weight import load_start_weights, weight_path
from lit_minimind.cli.help import DESCRIPTION, HELP_TRAINER, PROG, USAGE, HelpFormatter, arrange
from lit_minimind.cli.output import lines_start_lines
from lit_minimind.cli.presets import DEFAULT_CONFIG, resolve_presets  # lit_minimind/conf, in the package
from lit_minimind.cli.stage import apply_stage_defaults
from lit_minimind.cli.validate import parse_error_line, validate
from lit_minimind.data.datamodule import MiniMindDataModule
from lit_minimind.errors import CheckpointError, DataError, UsageError, say
from lit_minimind.model.minimind import SkipWeightInit
from lit_minimind.model.module import LitMiniMind
from lit_minimind.resume.internals import MiniMindSummary
from lit_minimind.resume.remote import REMOTE_BEHIND_EXIT


class MiniMindCLI(LightningCLI):
    """LightningCLI with the resume callback, MiniMind's console line and ``--ckpt_path``."""

    def init_parser(self, **kwargs: Any) -> Any:
        """No abbreviated flags: ``--trainer.max_epoch`` is an unknown flag (did you mean ...?), not ``max_epochs``."""
        kwargs.setdefault("allow_abbrev", False)
        return super().init_parser(**kwargs)

    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.add_lightning_class_args(ResumeCallback, "resume")
        parser.add_lightning_class_args(MiniMindConsole, "console")
        parser.add_lightning_class_args(Watchdog, "watchdog")  # hangs end the process (exit 6)
        parser.add_argument("--log_interval", type=int, default=100, help="print MiniMind's console line every N batches")
        parser.link_arguments("log_interval", "console.log_interval")
        parser.add_argument(
            "--ckpt_path",
            type=str | None,
            default=None,
            help="resume from: 'last' (newest valid checkpoint in --resume.ckpt_dir; starts fresh if none), "
            "a Lightning .ckpt, or a MiniMind *_resume.pth (ours or original MiniMind's)",
        )
        parser.add_argument(
            "--from_weight", type=str, default="none",
            help="start from weights (fresh optimizer and position), MiniMind's --from_weight: a NAME "
            "({resume.out_dir}/{NAME}_{hidden}[_moe].pth) or a file; 'none' = random init; a checkpoint "
            "found by --ckpt_path wins",
        )
        parser.add_argument("--export_hf", type=str | None, default=None,
                            help="after training, write the final weights as a Hugging Face directory (Qwen3 / "
                            "Qwen3-MoE, fp16, with the tokenizer) to DIR, replacing an earlier export there")
        arrange(parser)  # --help: the project's groups first, the Trainer's last (lit_minimind.cli.help)

    def parse_arguments(self, parser: Any, args: Any) -> None:
        """jsonargparse's errors (raised: exit_on_error=False) as one line naming the flag."""
        self.given_args = list(args)  # for apply_stage_defaults
        if HELP_TRAINER in args:  # --help with Lightning's full text of each --trainer.* flag
            HelpFormatter.full_trainer = True
            args = ["--help" if a == HELP_TRAINER else a for a in args]
        try:  # args is main()'s translated argv: parse it as the command line (no "args and sys.argv" warning)
            self.config = parser.parse_args(args)
        except ArgumentError as err:
            flags = sorted({s for a in parser._actions for s in a.option_strings if s.startswith("--")})
            raise UsageError(parse_error_line(str(err), flags)) from None
        validate(self.config)  # every value a user can type, before anything is seeded or built

    def before_instantiate_classes(self) -> None:
        for line in apply_stage_defaults(self.config, self.parser, self.given_args):  # LoRA, DPO, SFT names
            rank_zero_print(line)
        trainer = self.config.get("trainer")
        own_bar = any("ProgressBar" in str(getattr(cb, "class_path", cb)) for cb in trainer.get("callbacks") or [])
        given = trainer.get("enable_progress_bar")  # None: not given; false: no bar, no progress lines
        if given is not False and not own_bar:  # 1-based epochs, as the console
            # a log file (stdout not a terminal): plain progress lines, unless the bar is asked for explicitly
            terminal = sys.stdout.isatty() or given is True
            self.trainer_defaults["callbacks"] = [MiniMindProgressBar() if terminal else PlainProgress()]
        own_summary = any("ModelSummary" in str(getattr(cb, "class_path", cb)) for cb in trainer.get("callbacks") or [])
        if trainer.get("enable_model_summary") is not False and not own_summary:  # plain text, no "FLOPs: 0"
            self.trainer_defaults.setdefault("callbacks", []).append(MiniMindSummary())

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        """SLURM's plugins join the ``--trainer.plugins`` given (ResumeCallback installs its checkpoint storage)."""
        plugins = (self.config_init.get("trainer") or {}).get("plugins")
        plugins = [] if plugins is None else list(plugins) if isinstance(plugins, list) else [plugins]
        plugins += cluster_plugins(plugins, (self.config_init.get("trainer") or {}).get("strategy"))  # SLURM: SIGUSR1 is ours
        return super().instantiate_trainer(plugins=plugins, **kwargs)

    def instantiate_classes(self) -> None:
        one_line_warnings()  # warnings attributed to the project's code: one line
        # a resume overwrites every weight: they are built uninitialised, drawing nothing (initialise_weights)
        self.rng_before_model = torch.get_rng_state()
        self.weights_uninitialised = bool(self.config.get("ckpt_path"))
        try:
            with SkipWeightInit() if self.weights_uninitialised else contextlib.nullcontext():
                super().instantiate_classes()
        except (ValueError, TypeError, MisconfigurationException) as err:  # a value the classes refuse: a user error
            if isinstance(err, (DataError, UsageError)):
                raise
            raise UsageError(str(err).strip().splitlines()[0]) from None
        hide_limit_line_after_a_stop(next((cb for cb in self.trainer.callbacks if isinstance(cb, ResumeCallback)), None))

    def initialise_weights(self, restored: bool) -> None:
        """The model's random initialisation, skipped at instantiation for ``--ckpt_path``, unless the start
        overwrites every weight (``restored``): the model is built again from the generator's state before it,
        exactly as without ``--ckpt_path`` (no checkpoint found, LoRA's base, an original MiniMind file)."""
        if self.weights_uninitialised and not restored:
            torch.set_rng_state(self.rng_before_model)
            init_args = {k: v for k, v in self.model.hparams.items() if not k.startswith("_")}  # not LightningCLI's
            self.model = type(self.model)(**init_args)
        self.weights_uninitialised = False


class LimitLineAfterAStop(logging.Filter):
    """Drops Lightning's "`Trainer.fit` stopped: `max_epochs=2` reached." when a stop signal ended the run
    (the epoch a signal cuts short still counts as processed): the resume callback's "stopped by SIGTERM
    ..." says what happened."""

    def __init__(self) -> None:
        super().__init__()
        self.resume: ResumeCallback | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        stopped = self.resume is not None and self.resume.stopped_by is not None
        return not (stopped and record.getMessage().startswith("`Trainer.fit` stopped: `max_"))


LIMIT_LINE_AFTER_A_STOP = LimitLineAfterAStop()
RANK_ZERO_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")  # rank_zero_info's


def hide_limit_line_after_a_stop(resume: ResumeCallback | None) -> None:
    """Install :class:`LimitLineAfterAStop` for this run's resume callback (once per process; a later run's replaces it)."""
    LIMIT_LINE_AFTER_A_STOP.resume = resume
    for name in RANK_ZERO_LOGGERS:
        logging.getLogger(name).addFilter(LIMIT_LINE_AFTER_A_STOP)  # addFilter adds it once


LIT_MINIMIND_DIR = Path(__file__).resolve().parents[1]


def one_line_warnings() -> None:
    """A warning raised from the project's code (a library's warning attributed to its caller here) as one line:
    Python's first line, without the source line under it, as Lightning prints its own. (The project's own
    messages are plain lines: :func:`lit_minimind.errors.say`.) Wraps ``warnings.formatwarning`` once per process."""
    previous = warnings.formatwarning
    if getattr(previous, "one_line", False):
        return

    def formatwarning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                      line: str | None = None) -> str:
        ours = Path(filename).resolve().is_relative_to(LIT_MINIMIND_DIR)
        return previous(message, category, filename, lineno, "" if ours else line)  # "": no source line

    formatwarning.one_line = True  # type: ignore[attr-defined]
    warnings.formatwarning = formatwarning


_NO_KERNEL = re.compile(r"(\S+) does not have a deterministic implementation")


def nondeterministic_op(error: BaseException) -> str | None:
    """One line for torch's error on an op without a deterministic kernel under
    ``--trainer.deterministic true``; ``None`` for any other error."""
    match = _NO_KERNEL.search(str(error)) if isinstance(error, RuntimeError) else None
    if match is None:
        return None
    return (f"{match.group(1)} has no deterministic kernel on this device, and --trainer.deterministic true "
            "(the default, for a bit-exact resume) allows no other: rerun with --trainer.deterministic false "
            "(faster; a resume then matches the uninterrupted run within floating-point noise, not bit for bit)")


def summary(cli: MiniMindCLI, resume: ResumeCallback, console: MiniMindConsole, log_dir: str | None,
            exported: str | None = None) -> str:
    trainer = cli.trainer
    tokens_per_s = console.tokens / console.train_seconds if console.train_seconds else 0.0
    ckpt_dir = Path(resume.manager.files.ckpt_dir)
    saved = ckpt_dir.is_dir() and any(ckpt_dir.iterdir())  # --trainer.max_epochs 0: never created
    lines = [
        "",
        "== lit-minimind summary ==",
        *(["nothing was trained in this run (0 batches)"] if not console.batches else []),
        f"global steps: {trainer.global_step} (optimizer), batches this run: {console.batches}, epochs: {trainer.current_epoch}",
        f"loss: first {console.first_loss:.4f} -> last {console.last_loss:.4f}" if console.first_loss is not None else "loss: -",
        f"throughput: {tokens_per_s:,.0f} tokens/s over {console.train_seconds:.1f} s",
        f"fp16 weights: {resume.manager.saved_files[0] if resume.manager.saved_files else '-'}",
        f"resume checkpoints: {ckpt_dir}/ (resume with --ckpt_path last)" if saved else "resume checkpoints: - (none saved)",
        f"logs: {log_dir}",
        *([f"Hugging Face export: {exported}"] if exported else []),
        *([resume.manager.remote.summary()] if resume.manager.remote is not None else []),
    ]
    return "\n".join(lines)


def wandb_offline_without_credentials() -> None:
    """wandb never blocks or fails a run: without credentials it logs offline (WANDB_MODE is respected)."""
    if "WANDB_MODE" in os.environ or os.environ.get("WANDB_API_KEY"):
        return
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    if netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore"):
        return
    os.environ["WANDB_MODE"] = "offline"


def wandb_flush_often() -> None:
    """wandb writes its run file every 15 s by default; a SIGKILL loses what was not written.
    Flushing every second keeps what was logged before a checkpoint (later steps are re-run)."""
    os.environ.setdefault("WANDB__TRANSACTION_LOG_FLUSH_INTERVAL", "1")


@rank_zero_only
def rank_zero_print(line: str) -> None:
    print(line, flush=True)


def main(args: list[str] | None = None) -> int:
    """Run the CLI on ``args`` (default ``sys.argv[1:]``); returns the exit code (2: a user error)."""
    STOP.install()  # a stop signal from here on is honoured (exit 0, nothing lost), even during start-up
    STOP.hold_sigterm()  # no Lightning SIGTERM handler (a broadcast under DDP) runs before training starts
    restore_streams = lines_start_lines()  # an error: line, a warning never continues a progress bar's line
    try:
        return run_fit(args)
    finally:
        STOP.release_sigterm()  # (training released it already, unless it never started)
        restore_streams()


def run_fit(args: list[str] | None) -> int:
    """:func:`main` once the stop signals are handled."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Lightning's notices a user cannot act on (its tips, "GPU available", torch's LeafSpec deprecation in
    # Lightning 2.6, ...): filtered unless LIT_MINIMIND_VERBOSE=1 (lit_minimind.cli.output)
    hide_harmless_noise()
    wandb_offline_without_credentials()
    wandb_flush_often()
    origins: dict[str, str] = {}
    try:
        # MiniMind's train_pretrain.py flags mean what they mean there (lit_minimind.cli.flags)
        translation = translate(sys.argv[1:] if args is None else list(args),
                                compile_supported="compile" in inspect.signature(LitMiniMind).parameters)
        origins = translation.origins
        for line in filter(None, [mapping_line(translation), *translation.notes]):
            rank_zero_print(line)
        cli = MiniMindCLI(
            LitMiniMind,
            MiniMindDataModule,
            run=False,
            args=resolve_presets(translation.args),  # --config NAME: the packaged preset NAME.yaml
            # the embedded default is the base of every run; flags and --config presets override it;
            # parse errors are raised (not exit(2) with the usage) and printed as one line
            parser_kwargs={"default_config_files": [str(DEFAULT_CONFIG)], "exit_on_error": False,
                           "epilog": help_epilog(), "formatter_class": HelpFormatter, "prog": PROG,
                           "usage": USAGE, "description": DESCRIPTION},
            seed_everything_default=42,
            save_config_kwargs={"overwrite": True},
            auto_configure_optimizers=False,  # AdamW + MiniMind's LR rule live in LitMiniMind
            trainer_defaults={"use_distributed_sampler": False, "log_every_n_steps": 1},
        )
        resume = next(cb for cb in cli.trainer.callbacks if isinstance(cb, ResumeCallback))
        console = next(cb for cb in cli.trainer.callbacks if isinstance(cb, MiniMindConsole))
        # every directory the run writes, before anything is made there (a download, a log directory)
        check_run_dirs(cli.trainer, cli.model, resume.manager, fresh=not cli.config.get("ckpt_path"))
        # what trainer.fit(ckpt_path="last") would choose, chosen here: --from_weight depends on it
        ckpt_path = resume.choose(cli.trainer, cli.model, cli.config.get("ckpt_path"), cli.datamodule)
        cli.initialise_weights(restored=resume.manager.restores_every_weight(cli.trainer, cli.model))
        start = weight_path(cli.config.get("from_weight"), resume.manager.files.out_dir, cli.model.config.hidden_size,
                            cli.model.config.use_moe)
        if start is not None and (ckpt_path is None or cli.model.needs_start_weights):
            # MiniMind's --from_weight: only when not resuming, but for the LoRA base and the DPO reference
            rank_zero_print(load_start_weights(cli.model, start))
        if start is not None and cli.model.needs_start_weights:
            cli.model.use_start_weights(start)
        elif start is not None and ckpt_path is not None and cli.config.get("ckpt_path") == "last":
            rank_zero_print(f"--from_weight {start} not used: resuming from {ckpt_path}")
        elif start is not None and ckpt_path is not None:
            say(f"--from_weight {start} ignored: --ckpt_path {ckpt_path} is given")
        cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=ckpt_path)
        exported = export_after_fit(cli.config.get("export_hf"), resume, cli.datamodule, cli.trainer)
    except (CheckpointError, DataError, UsageError) as err:
        print(f"error: {name_origins(str(err), origins)}", file=sys.stderr)
        return 2
    except Exception as err:  # a DDP peer died or timed out: one line and exit 3, no hang, no traceback
        no_kernel = nondeterministic_op(err)
        if no_kernel is not None:
            print(f"error: {no_kernel}", file=sys.stderr, flush=True)
            return 2
        advice = lost_peer_advice(err)
        if advice is None:
            raise
        print(advice, file=sys.stderr, flush=True)
        return LOST_PEER_EXIT
    log_dir = cli.trainer.log_dir  # a collective under DDP: every rank asks
    if cli.trainer.is_global_zero:
        print(summary(cli, resume, console, log_dir, exported), flush=True)
    # SLURM + SIGUSR1: rank 0 requeues the job, now that the stop's checkpoint is committed on disk
    code = requeue_if_preempted(cli.trainer, resume.stopped_by, cli.config.get("ckpt_path"))
    if not resume.manager.remote_holds and code == 0:  # said by the callback at the end of the fit
        code = REMOTE_BEHIND_EXIT
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()  # a clean exit for every rank
    return code


if __name__ == "__main__":
    sys.exit(main())
