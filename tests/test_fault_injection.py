"""A full or failing disk at every file operation of a save (each write, fsync, manifest, rename and
directory fsync of each of its files): the run stops with exit 2 naming the failure, and
``--ckpt_path last`` then ends exactly like the uninterrupted run.

The faults are injected from the tests into the writer (``LIT_MINIMIND_TEST_FAIL=OP:KIND:N:ERRNO``,
:mod:`tests.helpers.faults`, no hook in the package): a real EIO
cannot be produced here; a real full disk and a read-only mount are tested in test_fault_tolerance."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from tests.helpers.runs import assert_resumed, cli_env, need_shared, run_cli, tiny_args

OPS = {"checkpoint": ["write", "fsync", "manifest", "rename", "dirfsync"],
       "resume": ["link", "manifest", "rename", "dirfsync"],  # a hard link: no data written
       "export": ["write", "fsync", "manifest", "rename", "dirfsync"]}
CODES = ["ENOSPC", "EIO"]
FAST = {("write", "checkpoint", "ENOSPC")}


def marks(op: str, kind: str, code: str) -> tuple:
    """make test: one case; make test-slow: every operation of every file once, the two codes alternating;
    make test-matrix: the other code of each (the same path, another message)."""
    if (op, kind, code) in FAST:
        return ()
    return (pytest.mark.slow,) if code == CODES[OPS[kind].index(op) % 2] else (pytest.mark.matrix,)


CASES = [pytest.param(op, kind, code, marks=marks(op, kind, code), id=f"{op}-{kind}-{code}")
         for kind in OPS for op, code in itertools.product(OPS[kind], CODES)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    need_shared()
    ref_dir = tmp_path_factory.mktemp("ref")
    ref = run_cli(ref_dir, tiny_args(epochs=1, accumulate=2, save_interval=5))
    assert ref.returncode == 0, ref.stderr[-2000:]
    return {"steps": ref.steps, "export": torch.load(ref_dir / "out" / "pretrain_64.pth", weights_only=True)}


@pytest.mark.parametrize(("op", "kind", "code"), CASES)
def test_fault_in_a_save_stops_clearly_and_resumes_exactly(tmp_path: Path, reference: dict, op: str, kind: str,
                                                          code: str) -> None:
    args = tiny_args(epochs=1, accumulate=2, save_interval=5)
    # the second save (step 10) fails; the first (due at step 5, taken at its optimizer step 6) is complete
    failed = run_cli(tmp_path, args, env=cli_env(LIT_MINIMIND_TEST_FAIL=f"{op}:{kind}:2:{code}"))
    assert failed.returncode == 2, failed.stderr[-2000:]
    errors = [line for line in failed.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "could not save the checkpoint at epoch 1 step 10" in errors[0], failed.stderr[-2000:]
    assert ("No space left" if code == "ENOSPC" else "Input/output error") in errors[0]
    assert "Traceback" not in failed.stderr
    assert not list(tmp_path.glob("*/*.tmp")), "a failed write left a temporary file"

    resumed = run_cli(tmp_path, args + ["--ckpt_path", "last"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    # a fault before the checkpoint itself was in place: from the step-6 save; after it (in the
    # MiniMind files, or in the checkpoint's directory fsync, the file renamed already): from step 10's
    at = (1, 11) if kind != "checkpoint" or op == "dirfsync" else (1, 7)
    assert_resumed(resumed, *at)
    # every step the uninterrupted run trained from there, with its values
    assert resumed.steps == {key: values for key, values in reference["steps"].items() if key >= at}
    export = torch.load(tmp_path / "out" / "pretrain_64.pth", weights_only=True)
    assert export.keys() == reference["export"].keys()
    assert all(torch.equal(export[k], reference["export"][k]) for k in reference["export"])
