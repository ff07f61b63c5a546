"""What a user sees: MiniMind's console line on its own line beside a live progress bar, and a run
that can never end refused with one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.runs import LINE_RE, need_shared, run_cli, tiny_args


@pytest.mark.slow  # make test's budget: 14.6 min on a clean clone, 2026-12-03 (make test-slow)
def test_console_lines_stand_on_their_own_lines_beside_the_progress_bar(tmp_path: Path) -> None:
    need_shared()
    args = tiny_args(epochs=2, save_interval=100) + ["--trainer.enable_progress_bar", "true"]
    run = run_cli(tmp_path, args + ["--log_interval", "3"])  # the bar is on, as in a terminal or a log file
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Epoch 2/2: 100%" in run.stdout, "the progress bar was drawn"
    # a terminal shows what follows the last carriage return of each line: it must be the console line
    shown = [line.split("\r")[-1] for line in run.stdout.split("\n")]
    console = [line for line in shown if LINE_RE.search(line)]
    assert len(console) == 2 * 4, console  # steps 3, 6, 9, 12 of two epochs
    assert all(LINE_RE.fullmatch(line) for line in console), [line for line in console if not LINE_RE.fullmatch(line)]


def test_epochs_minus_one_without_an_end_is_one_error_line(tmp_path: Path) -> None:
    need_shared()
    run = run_cli(tmp_path, tiny_args() + ["--epochs", "-1"])
    assert run.returncode == 2
    errors = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("error: --trainer.max_epochs"), run.stderr
    assert "--trainer.max_steps" in errors[0] and "Traceback" not in run.stderr
