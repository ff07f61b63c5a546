"""A stop signal at any moment of start-up ends with exit 0, one line saying so, and nothing lost:
the run resumed afterwards ends exactly like the run never interrupted."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import assert_resumed, cli_env, need_shared, resumed_at, run_cli, tiny_args

# before restore and after it (before Lightning's handlers) behave like restore itself: `make test-slow`
PHASES = [pytest.param("setup", marks=pytest.mark.slow), "on_load_checkpoint",
          pytest.param("on_fit_start", marks=pytest.mark.slow), pytest.param("train_dataloader", marks=pytest.mark.slow),
          "on_train_batch_start"]


def signal_at(phase: str, signame: str = "SIGTERM") -> list[str]:
    return ["--trainer.callbacks+=tests.helpers.signal_at.SignalAt", f"--trainer.callbacks.phase={phase}",
            f"--trainer.callbacks.signame={signame}"]


@pytest.mark.parametrize("phase", PHASES)
def test_signal_during_start_up_of_a_resume(tmp_path: Path, phase: str) -> None:
    need_shared()
    args = tiny_args(epochs=1, accumulate=2, save_interval=4)
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    ref_dir.mkdir(), run_dir.mkdir()
    ref = run_cli(ref_dir, args)
    assert ref.returncode == 0, ref.stderr[-3000:]
    # killed right after the step-4 save's last file (its export, the 3rd commit)
    first = run_cli(run_dir, args, env=cli_env(LIT_MINIMIND_TEST_STOP_AFTER_SAVE="3"))
    assert first.returncode == -9 and "@@stopped-after-save" in first.stdout
    files = {p.name: p.read_bytes() for p in (run_dir / "checkpoints").glob("*.ckpt")}

    stopped = run_cli(run_dir, args + ["--ckpt_path", "last", *signal_at(phase)])
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert "Traceback" not in stopped.stderr
    assert "SIGTERM received" in stopped.stdout
    assert len([line for line in stopped.stderr.splitlines() if "stopped by SIGTERM" in line]) == 1, stopped.stderr[-2000:]
    if phase in ("on_fit_start", "train_dataloader", "on_train_batch_start") or resumed_at(stopped):  # restored
        assert_resumed(stopped, 1, 5)
    if phase != "on_train_batch_start":  # nothing trained: the checkpoints are the same files
        assert not stopped.steps
        assert {p.name: p.read_bytes() for p in (run_dir / "checkpoints").glob("*.ckpt")} == files
    else:  # the first batch's window completes, is saved, then the run stops
        assert sorted(stopped.steps) == [(1, 5), (1, 6)]

    done = run_cli(run_dir, args + ["--ckpt_path", "last"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert_resumed(done, 1, 7 if phase == "on_train_batch_start" else 5)
    for run in (first, stopped, done):
        for key, values in run.steps.items():
            assert values == ref.steps[key], key
    ref_w = torch.load(ref_dir / "out" / "pretrain_64.pth", weights_only=True)
    got_w = torch.load(run_dir / "out" / "pretrain_64.pth", weights_only=True)
    assert all(torch.equal(ref_w[k], got_w[k]) for k in ref_w)


@pytest.mark.parametrize("phase", ["setup", "train_dataloader"])
def test_signal_during_start_up_of_a_fresh_run(tmp_path: Path, phase: str) -> None:
    need_shared()
    run = run_cli(tmp_path, tiny_args(epochs=1) + signal_at(phase, "SIGUSR1"))
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Traceback" not in run.stderr and "stopped by SIGUSR1" in run.stderr
    assert not run.steps and not list((tmp_path / "checkpoints").glob("*.ckpt"))
