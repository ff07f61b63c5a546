"""The pre-flight check's three refusals, each by its own first words (issue 51): a directory that cannot be
written, one whose path runs through a regular file, a file system without room for one save. Each is the real
``python -m lit_minimind.fit`` (the embedded default config) in a subprocess: one ``error:`` line, exit 2,
nothing trained, nothing left behind. ``/proc/nope`` was reported as a full disk ("0.0 MB free on its file
system ... free space"): root passes ``os.access`` there, and ``/proc`` has no storage to count."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.helpers.runs import cli_env

ARGS = ["--trainer.max_steps", "1", "--trainer.enable_progress_bar", "false"]


def fit(cwd: Path, *args: str, mount: tuple[str, Path] | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "lit_minimind.fit", *ARGS, *args]
    if mount:  # a fresh tmpfs at mount[1] in a private mount namespace (root only); 97: could not mount
        script = f'mount -t tmpfs -o {mount[0]} tmpfs "{mount[1]}" || exit 97; exec "$@"'
        command = ["unshare", "-m", "sh", "-c", script, "sh", *command]
    return subprocess.run(command, cwd=cwd, env=cli_env(), capture_output=True, text=True, timeout=300)


def the_error(run: subprocess.CompletedProcess) -> str:
    """The run's one ``error:`` line, after checking it stopped as a refusal does."""
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert run.returncode == 2 and len(errors) == 1, (run.returncode, run.stderr[-3000:])
    assert "Traceback" not in run.stderr and "Epoch:[" not in run.stdout, run.stderr[-3000:]
    return errors[0]


def test_unwritable_and_not_a_directory_are_said_as_such_not_as_a_full_disk(tmp_path: Path) -> None:
    (tmp_path / "notes").write_text("mine\n")  # a regular file: notes/out cannot be a directory
    with ThreadPoolExecutor(max_workers=2) as pool:
        proc, under_file = pool.map(lambda args: fit(tmp_path, *args), [("--resume.out_dir", "/proc/nope"),
                                                                          ("--resume.out_dir", "notes/out")])
    error = the_error(proc)
    assert error.startswith("error: --resume.out_dir /proc/nope: not writable: "), error
    # as root: /proc has no storage; as another user: permission denied. Never a full disk.
    assert ("a virtual file system, no storage" if os.geteuid() == 0 else "permission denied") in error, error
    assert "MB free" not in error and "free space" not in error, error
    assert error.endswith("(cannot create it in /proc); nothing was started - choose a writable directory"), error

    error = the_error(under_file)
    assert error == f"error: --resume.out_dir notes/out: not a directory ({tmp_path / 'notes'} is a file); nothing was started"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes"] and (tmp_path / "notes").read_text() == "mine\n"


def test_no_space_is_said_with_what_is_free_and_needed(tmp_path: Path) -> None:
    """out/ on a 1 MB tmpfs, the default model's fp16 export needing ~3.6 MB: refused before the first batch,
    by what is free and what is needed (the same words as before issue 51: not taken for an unwritable one)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) for a small tmpfs")
    (tmp_path / "out").mkdir()
    run = fit(tmp_path, "--resume.out_dir", "out", mount=("size=1m", tmp_path / "out"))
    if run.returncode == 97:
        pytest.skip(f"cannot mount a tmpfs here: {run.stderr[:200]}")
    error = the_error(run)
    assert error.startswith("error: --resume.out_dir out: 1.0 MB free on its file system, ~"), error
    assert error.endswith("nothing was started - free space or choose another directory"), error
    assert "not writable" not in error and "not a directory" not in error, error
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and not list((tmp_path / "out").iterdir())
