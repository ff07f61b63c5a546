"""A command's process ends soon after its last line (docs/several-machines.md, "Exit time"): every entry point collects the garbage
once and freezes what is left before the interpreter's teardown, whose own collections would otherwise walk torch's
and Lightning's objects (about 0.7 s on this VM). Checked by what it does (the freeze, atexit handlers still run),
not by a clock; the seconds are ``bench_restart``'s exit phase."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.runs import ROOT, cli_env

PROBE = """
import atexit, gc, runpy, sys
atexit.register(lambda: print("@@frozen", gc.get_freeze_count() > 0, flush=True))  # runs after the command's end
sys.argv = [{module!r}, *{args!r}]
runpy.run_module({module!r}, run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("module, args, code", [
    ("lit_minimind.fit", ["--ckpt_path", "missing.ckpt", "--trainer.accelerator", "cpu"], 2),  # after the imports
    ("lit_minimind.inspect", ["missing.pth"], 1),
])
def test_an_entry_point_freezes_the_heap_before_the_teardown_and_atexit_still_runs(module: str, args: list[str],
                                                                                   code: int, tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", PROBE.format(module=module, args=args)], cwd=tmp_path, env=cli_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == code, done.stderr[-2000:]
    assert "missing" in done.stdout + done.stderr  # the command ran to its own error
    assert "@@frozen True" in done.stdout, (done.stdout[-1000:], done.stderr[-1000:])


def test_importing_an_entry_point_module_freezes_nothing() -> None:
    """A program importing the package (a notebook, a user's script) keeps its garbage collection as it was."""
    code = "import gc, lit_minimind.fit, lit_minimind.generate; print(gc.get_freeze_count())"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=cli_env(), capture_output=True, text=True,
                          timeout=120)
    assert done.stdout.strip() == "0", done.stderr[-2000:]
