"""Every command's ``--help`` as a user reads it (issue 51): plain text (no reStructuredText ``literals``),
``fit`` naming every stage it trains without jsonargparse's "default config file locations" block, and
``generate``'s sampling flags each described with its default. Each help is the real command in a subprocess."""

from __future__ import annotations

import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.helpers.runs import cli_env

COMMANDS = ["fit", "generate", "serve", "eval", "eval_toolcall", "inspect", "export", "merge_lora", "train_tokenizer"]


def helps(cwd: Path) -> dict[str, str]:
    def one(command: str) -> str:
        run = subprocess.run([sys.executable, "-m", f"lit_minimind.{command}", "--help"], cwd=cwd, env=cli_env(),
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0 and run.stdout.startswith(f"usage: python -m lit_minimind.{command} "), \
            (command, run.stdout[:500], run.stderr[-2000:])
        return run.stdout

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(COMMANDS, pool.map(one, COMMANDS)))


def flag_help(text: str, flag: str) -> str:
    """The help of ``flag`` (argparse's layout: on the flag's line after two spaces, or on the lines below it)."""
    m = re.search(rf"^  {re.escape(flag)}(?: [A-Z_]+)?(?:  +(.*))?\n((?: {{10,}}.*\n)*)", text, re.M)
    assert m, f"{flag} not in:\n{text}"
    return " ".join(f"{m[1] or ''} {m[2]}".split())


def test_every_commands_help_is_plain_text_and_says_what_it_does(tmp_path: Path) -> None:
    texts = helps(tmp_path)
    for command, text in texts.items():
        for markup in ("``", ":class:", ":mod:", ":func:"):
            assert markup not in text, f"{markup} in {command} --help:\n{text}"
        if command != "fit":  # the first paragraph of the module's docstring, as a sentence
            description = " ".join(text.split("\n\n")[1].split())
            assert description.startswith(f"python -m lit_minimind.{command} ") and description.endswith("."), description

    generate = texts["generate"]
    for flag, default in [("--max_new_tokens", "64"), ("--top_p", "0.9"), ("--top_k", "0"), ("--seed", "0"),
                          ("--temperature", "0.8")]:
        described = flag_help(generate, flag)
        assert described.endswith(f"(default: {default})"), (flag, described)
        assert len(described.removesuffix(f"(default: {default})").split()) >= 4, (flag, described)

    fit = texts["fit"]
    head = " ".join(fit.split("\n\n")[1].split())  # the description, after the usage
    for stage in ("pretraining", "SFT", "LoRA", "DPO", "reward model", "GRPO", "CISPO", "distillation"):
        assert stage in head, (stage, head)
    assert "default config file locations" not in fit and "default values below are the ones overridden" not in fit
    assert "default.yaml" in fit  # where the defaults shown come from: said in the description
    assert "--model.hidden_size" in fit and "--trainer.max_epochs" in fit
