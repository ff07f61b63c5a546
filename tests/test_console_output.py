"""What the console shows (issue 32): ``--help`` led by the project's own flags in plain text, plain
progress lines when stdout is a log file, a tqdm bar that knows its epoch, total and ETA after a
mid-epoch resume in a terminal, ``error:`` lines that start lines, and none of Lightning's harmless
notices (``LIT_MINIMIND_VERBOSE=1`` brings them back). Every check runs the real command in a
subprocess: with pipes (not a terminal: ``isatty()`` is False) or a pseudo-terminal (``pty``)."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
import yaml

from lit_minimind.cli.flags import MINIMIND_FLAGS
from lit_minimind.cli.presets import DEFAULT_CONFIG
from tests.helpers.runs import LINE_RE, cli_env, need_shared, tiny_args

FIT = [sys.executable, "-m", "lit_minimind.fit"]
PROGRESS_RE = re.compile(r"progress: epoch (\d+)/(\d+) step (\d+)/(\d+) \((\d+)%\) [\d.]+ it/s, eta \d+:\d\d:\d\d")
# what a run must not show unless LIT_MINIMIND_VERBOSE=1 (each appears in NOISY's run without the filters)
NOISE = {
    "litlogger tip": "💡 Tip: For seamless cloud logging",
    "GPU available": "GPU available: ",
    "TPU available": "TPU available: ",
    "FLOPs of the summary": "total flops",
    "summary precision": "is not supported by the model summary",
    "tensorboardX notice": "`tensorboardX` has been removed",
    "log_every_n_steps": "is smaller than the logging interval",
    "LeafSpec deprecation": "LeafSpec",
}
# the flags that make Lightning print each notice: the model summary on, bf16-mixed, logger=True, a log
# interval above the epoch's 12 batches
NOISY = ["--trainer.enable_model_summary", "true", "--trainer.precision", "bf16-mixed", "--trainer.logger", "true",
         "--trainer.log_every_n_steps", "50"]


def without(args: list[str], *flags: str) -> list[str]:
    """``args`` without each of ``flags`` and its value."""
    out, i = [], 0
    while i < len(args):
        if args[i] in flags:
            i += 2
            continue
        out.append(args[i])
        i += 1
    return out


def bar_default(*extra: str, epochs: int = 1) -> list[str]:
    """tiny_args with the progress bar left to the CLI's choice (tiny_args turns it off)."""
    return without(tiny_args(*extra, epochs=epochs), "--trainer.enable_progress_bar")


def run_piped(cwd: Path, args: list[str], timeout: float = 300, **env: str) -> tuple[int, str]:
    """The CLI with stdout and stderr into one pipe, as ``> log 2>&1``: (exit code, what the log holds)."""
    proc = subprocess.run([*FIT, *args], cwd=cwd, env=cli_env(**env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=timeout)
    return proc.returncode, proc.stdout


def run_pty(cwd: Path, args: list[str], timeout: float = 300, **env: str) -> tuple[int, str]:
    """The CLI on a pseudo-terminal (stdout and stderr a 40x120 terminal): (exit code, what it showed)."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # tqdm draws nothing at 0 columns
    proc = subprocess.Popen([*FIT, *args], cwd=cwd, env=cli_env(**env), stdin=follower, stdout=follower,
                            stderr=follower, close_fds=True)
    os.close(follower)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not select.select([leader], [], [], 1.0)[0]:
                if proc.poll() is not None:
                    break
                continue
            try:
                data = os.read(leader, 65536)
            except OSError:  # EIO: every holder of the terminal's other end is gone
                break
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(leader)
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=60)
    return proc.returncode, b"".join(chunks).decode(errors="replace").replace("\r\n", "\n")  # the pty's line ends


def assert_errors_start_lines(text: str) -> None:
    starts = [m.start() for m in re.finditer("error:", text)]
    assert starts, text[-2000:]
    glued = [text[max(0, i - 80):i + 40] for i in starts if i > 0 and text[i - 1] != "\n"]
    assert not glued, f"an error: line continues another line: {glued}"


# ------------------------------------------------------------------ --help
def help_text(cwd: Path, flag: str = "--help") -> str:
    proc = subprocess.run([*FIT, flag], cwd=cwd, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow  # make test's budget: 14.6 min on a clean clone, 2026-12-03 (make test-slow)
def test_help_starts_with_the_projects_flags_in_plain_text(tmp_path: Path) -> None:
    text = help_text(tmp_path)
    lines = text.splitlines()
    assert lines[0].startswith("usage: python -m lit_minimind.fit "), lines[0]
    head = "\n".join(lines[:60])
    # --model.hidden_size within the first 60 lines, with a description and default.yaml's default
    m = re.search(r"^  --model\.hidden_size .*\n((?: {10,}.*\n)+)", head + "\n", re.M)
    assert m, head
    described = " ".join(m[1].split())
    default = yaml.safe_load(DEFAULT_CONFIG.read_text())["model"]["hidden_size"]
    assert f"default: {default})" in described, described
    assert len(described.split("(type:")[0].split()) >= 3, f"no description: {described}"
    for markup in ("``", ":class:", ":mod:", ":func:", ":meth:", ":fu"):
        assert markup not in text, f"{markup} in --help"
    # every --model.* flag is described (not only its type and default)
    blocks = re.findall(r"^  (--model\.\w+) .*\n((?: {10,}.*\n)*)", text, re.M)
    undescribed = [flag for flag, block in blocks if not " ".join(block.split()).split("(type:")[0].strip()]
    assert len(blocks) >= 10 and not undescribed, undescribed
    # the project's flags, then the Trainer's; Lightning's full text only behind --help_trainer
    assert text.index("--export_hf") < text.index("--trainer.max_epochs") < text.index("MiniMind's flags")
    assert "--help_trainer" in "\n".join(lines[:20])
    assert "DD:HH:MM:SS" not in text, "the Trainer's flags should be one sentence each in --help"
    full = help_text(tmp_path, "--help_trainer")
    assert "DD:HH:MM:SS" in full and "``" not in full and ":class:" not in full
    # the mapping of MiniMind's flags names every one the CLI translates, --lora_name included
    mapping = text[text.index("MiniMind's flags"):]
    missing = [f for f in MINIMIND_FLAGS if f"--{f}" not in mapping]
    assert "--lora_name" in mapping and not missing, missing


# ------------------------------------------------------------------ a log file: plain lines
@pytest.mark.slow  # make test's budget: 14.6 min on a clean clone, 2026-12-03 (make test-slow)
def test_a_piped_run_writes_plain_progress_lines_without_the_noise(tmp_path: Path) -> None:
    need_shared()
    code, log = run_piped(tmp_path, bar_default(*NOISY, "--log_interval", "4", epochs=2))
    assert code == 0, log[-3000:]
    assert "\r" not in log, "a tqdm bar (carriage returns) in a log file"
    progress = [PROGRESS_RE.fullmatch(line) for line in log.splitlines() if line.startswith("progress:")]
    assert all(progress), [line for line in log.splitlines() if line.startswith("progress:")]
    steps = [(int(m[1]), int(m[3])) for m in progress]
    assert steps == [(e, s) for e in (1, 2) for s in (4, 8, 12)], steps
    assert {(m[2], m[4], m[5]) for m in progress if m[3] == "8"} == {("2", "12", "66")}
    assert len([line for line in log.splitlines() if LINE_RE.fullmatch(line)]) == 6, "MiniMind's console line"
    assert "Trainable params" in log, "the model summary is still shown"
    shown = {name: text for name, text in NOISE.items() if text.lower() in log.lower()}
    assert not shown, f"harmless notices reached the console: {shown}"


@pytest.mark.slow  # make test's budget: 14.6 min on a clean clone, 2026-12-03 (make test-slow)
def test_verbose_shows_every_notice(tmp_path: Path) -> None:
    need_shared()
    code, log = run_piped(tmp_path, bar_default(*NOISY, "--log_interval", "4"), LIT_MINIMIND_VERBOSE="1")
    assert code == 0, log[-3000:]
    hidden = [name for name, text in NOISE.items() if text.lower() not in log.lower()]
    assert not hidden, f"LIT_MINIMIND_VERBOSE=1 still hides: {hidden}"


def test_enable_progress_bar_false_prints_no_progress_at_all(tmp_path: Path) -> None:
    need_shared()
    code, log = run_piped(tmp_path, tiny_args("--trainer.max_steps", "2"))  # tiny_args: --trainer.enable_progress_bar false
    assert code == 0, log[-3000:]
    assert "\r" not in log and "progress:" not in log
    assert [line for line in log.splitlines() if LINE_RE.fullmatch(line)], "MiniMind's console line"


# ------------------------------------------------------------------ error: lines
FAIL_SECOND_SAVE = {"LIT_MINIMIND_TEST_FAIL": "write:checkpoint:2:ENOSPC"}  # tests/helpers/faults.py, the background writer


@pytest.mark.parametrize("where", ["log file", "terminal"])
def test_an_error_line_starts_a_line_of_its_own(tmp_path: Path, where: str) -> None:
    """The second save's background write fails (a full disk): its ``error:`` line, printed on stderr
    while the bar (terminal) or the progress lines (log file) are on stdout, starts its own line."""
    need_shared()
    args = bar_default("--resume.save_interval", "3", "--log_interval", "5")
    code, text = (run_piped if where == "log file" else run_pty)(tmp_path, args, **FAIL_SECOND_SAVE)
    assert code == 2, text[-3000:]
    assert re.search(r"^error: could not save the checkpoint at epoch 1 step 6 .*No space left", text, re.M), text[-3000:]
    assert_errors_start_lines(text)
    if where == "terminal":
        assert re.search(r"Epoch 1/1: +\d+%", text), "the terminal run draws the bar"


# ------------------------------------------------------------------ a terminal: the bar after a mid-epoch resume
BAR_RE = re.compile(r"Epoch 1/1: +(\d+)%\|[^|\n\r]*\| +(\d+)/12 \[\d\d:\d\d<(\d\d:\d\d|\?), +[\d.?]+it/s\]")


@pytest.mark.slow
def test_the_bar_after_a_mid_epoch_resume_shows_epoch_total_and_eta(tmp_path: Path) -> None:
    need_shared()
    code, log = run_piped(tmp_path, tiny_args("--trainer.max_steps", "3"))  # saves after batch 6 of 12
    assert code == 0, log[-3000:]
    code, shown = run_pty(tmp_path, bar_default("--ckpt_path", "last", "--log_interval", "4"))
    assert code == 0, shown[-3000:]
    assert "resuming epoch 1 at step 7/12" in shown, shown[-3000:]
    frames = [f for f in re.split(r"[\r\n]", shown) if f.strip()]
    drawn = [BAR_RE.search(f) for f in frames]
    counts = [int(m[2]) for m in drawn if m]
    assert counts and min(counts) == 6 and max(counts) == 12, frames[-20:]
    assert any(m and int(m[2]) > 6 and m[3] != "?" for m in drawn), "no ETA after the resume"
    unknown = [f for f in frames if re.search(r"\| +[1-9]\d*/\?", f)]
    assert not unknown, f"a frame without the epoch's total: {unknown[:3]}"
