"""What a user meets (issue 32): a mistyped flag, a file that is no model, the modes of written files,
and the lines a run ends with. Each check runs the real command in a subprocess on real files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import cli_env


def run_module(module: str, *args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=cli_env(), capture_output=True,
                          text=True, timeout=timeout)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


# ------------------------------------------------------------------ no abbreviated flags
def test_an_abbreviated_flag_is_an_unknown_flag_and_nothing_is_written(tmp_path: Path) -> None:
    """``--trainer.max_epoch`` is not taken for ``--trainer.max_epochs`` (argparse's allow_abbrev):
    one error line naming the flag meant, exit 2, before anything is written. ``--help`` still works."""
    run = run_module("lit_minimind.fit", "--trainer.max_epoch", "1", cwd=tmp_path)
    assert run.returncode == 2, run.stderr[-3000:]
    assert error_lines(run.stderr) == ["error: unknown flag --trainer.max_epoch (did you mean --trainer.max_epochs?)"]
    assert "Traceback" not in run.stderr and "lit-minimind summary" not in run.stdout
    assert not list(tmp_path.iterdir())  # no out/, checkpoints/, lightning_logs/
    shown = run_module("lit_minimind.fit", "--help", cwd=tmp_path)
    assert shown.returncode == 0 and "--trainer.max_epochs" in shown.stdout, shown.stderr[-3000:]
