"""What ``python -m lit_minimind.fit --help`` prints: the project's own flags first (``--model.*``,
``--data.*``, ``--resume.*``, ``--console.*``, then ``--log_interval``, ``--ckpt_path``, ``--from_weight``,
``--export_hf``, ``--config``), each with its description and default, then Lightning's Trainer flags
(``--trainer.*``) one line each (``--help_trainer``: with Lightning's full text), then MiniMind's flags.

Descriptions come from the classes' docstrings (jsonargparse reads their ``Args:`` sections); they are
printed as plain text: Sphinx roles (``:class:`x```) and double backticks are dropped before wrapping.
"""

from __future__ import annotations

import re
from argparse import SUPPRESS
from typing import Any

from jsonargparse import DefaultHelpFormatter

from lit_minimind.cli.plain import plain

PROG = "python -m lit_minimind.fit"
HELP_TRAINER = "--help_trainer"
_INDENT = " " * len(f"usage: {PROG} ")
USAGE = (f"{PROG} [--config FILE] [--model.NAME V] [--data.NAME V] [--resume.NAME V]\n"
         f"{_INDENT}[--log_interval N] [--ckpt_path last|FILE] [--from_weight NAME|FILE]\n"
         f"{_INDENT}[--export_hf DIR] [--trainer.NAME V] [MiniMind's train_*.py flags]\n"
         f"{_INDENT}[-h | {HELP_TRAINER}]")
DESCRIPTION = f"""\
MiniMind's training stages on PyTorch Lightning: pretraining, SFT, LoRA, DPO, a reward model, GRPO/CISPO
(--model.loss_type; CISPO is MiniMind's default) and distillation, chosen by the data, --model.lora_rank and
--model.objective. With no flags it trains a small model on a corpus built from Python's own documentation,
on CPU.

This help: the project's flags first (--model.*, --data.*, --resume.*, --console.*, then --log_interval,
--ckpt_path, --from_weight, --export_hf, --config), with their defaults (the packaged default.yaml's
where it sets one); then Lightning's Trainer flags (--trainer.*), a sentence each ({HELP_TRAINER}: this
help with Lightning's full text of each); then MiniMind's own flags, which are accepted too."""

GROUP_TITLES = {
    "model": "--model.*: the model and its optimization (lit_minimind.model.LitMiniMind)",
    "data": "--data.*: the data, as MiniMind reads it (lit_minimind.data.MiniMindDataModule)",
    "resume": "--resume.*: checkpoints, MiniMind's weight files and exact resume (lit_minimind.callbacks.ResumeCallback)",
    "console": "--console.*: MiniMind's console line (lit_minimind.callbacks.MiniMindConsole)",
    "trainer": f"--trainer.*: Lightning's Trainer (first sentence of each; {HELP_TRAINER}: the full text)",
}
GROUP_DESCRIPTIONS = {"console": "Its one setting, log_interval, is --log_interval's (below)."}
OWN_TITLE = "--log_interval, --ckpt_path, --from_weight, --export_hf, --config and the other top-level flags"

def first_sentence(text: str) -> str:
    """The text up to its first sentence's end: a period and a space (or the end), not after e.g./i.e./etc."""
    for m in re.finditer(r"\.(?=\s|$)", text):
        if not re.search(r"(?:\b[a-z]\.[a-z]|\betc|\bvs)$", text[: m.start()]):
            return text[: m.end()]
    return text


class HelpFormatter(DefaultHelpFormatter):
    """jsonargparse's formatter (descriptions with ``type`` and ``default``) on plain text; the
    description and the epilog printed as written (their line breaks kept); the Trainer's flags cut
    to their first sentence unless ``full_trainer`` (``--help_trainer``)."""

    full_trainer = False

    def _get_help_string(self, action: Any) -> str:
        original = action.help
        if not isinstance(original, str):
            return super()._get_help_string(action)
        text = plain(original)
        if not self.full_trainer and str(getattr(action, "dest", "")).startswith("trainer."):
            # one line's worth: the first sentence and the default (no type, no list of subclasses)
            text = first_sentence(text)
            shown = action.option_strings and action.default is not SUPPRESS and not action.dest.endswith(".help")
            return text + (" (default: %(default)s)" if shown and "%(default)" not in text else "")
        action.help = text
        try:
            return super()._get_help_string(action)
        finally:
            action.help = original

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "".join(indent + line for line in text.splitlines(keepends=True))  # argparse's RawDescription


def arrange(parser: Any) -> None:
    """The project's groups first, titled by what they set; the top-level flags after them; the
    Trainer's last (argparse prints the groups in ``parser._action_groups`` order)."""
    groups = getattr(parser, "groups", None) or {}
    for key, group in groups.items():
        if key in GROUP_TITLES:
            group.title, group.description = GROUP_TITLES[key], GROUP_DESCRIPTIONS.get(key)
        elif "." not in key:  # a class group with its docstring's first line: as plain text, named by its flags
            group.title = f"--{key}.*: " + plain(group.title or "").rstrip(":")
    own = [g for g in parser._action_groups if g is parser._optionals]
    for g in own:
        g.title = OWN_TITLE
    trainer = [groups["trainer"]] if "trainer" in groups else []
    known = ("model", "data", "resume", "console")
    project = [groups[k] for k in known if k in groups]  # then any other class group the CLI adds
    project += [g for k, g in groups.items() if k not in known and k != "trainer" and "." not in k and g not in project]
    # jsonargparse's "default config file locations" group (the packaged default.yaml and a note that the
    # defaults shown are its values): not printed - the description says so in a sentence
    located = getattr(parser, "_default_config_files_group", None)
    first = [g for g in parser._action_groups if g is parser._positionals]
    rest = [g for g in parser._action_groups if g not in first + project + own + trainer and g is not located]
    parser._action_groups[:] = first + project + own + rest + trainer
