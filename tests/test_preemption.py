"""Preemption: SIGTERM / SIGINT / SIGUSR1 finish the optimizer step, save, exit 0; resume is exact."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch

from tests.helpers.runs import assert_resumed, at_line, at_text, need_shared, run_cli, tiny_args


# SIGUSR1 also saves and stops in tests/test_slurm.py (the requeued job resumes exactly)
@pytest.mark.parametrize("signame", ["SIGTERM", pytest.param("SIGINT", marks=pytest.mark.slow), pytest.param("SIGUSR1", marks=pytest.mark.matrix)])
def test_signal_saves_and_exits_zero_then_resume_is_exact(tmp_path: Path, signame: str) -> None:
    need_shared()
    args = tiny_args(epochs=2, accumulate=2, save_interval=100)
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    ref_dir.mkdir(), run_dir.mkdir()
    ref = run_cli(ref_dir, args)
    assert ref.returncode == 0

    stopped = run_cli(run_dir, args + ["--ckpt_path", "last"], on_line=at_line(3, lambda run: run.send(getattr(signal, signame))))
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert f"{signame} received" in stopped.stdout
    # the command has --ckpt_path last already: it resumes as it is
    assert "checkpoint saved. Resume with the same command\n" in stopped.stderr, stopped.stderr[-3000:]
    last_step = max(stopped.steps)
    assert last_step[1] % 2 == 0 and last_step < (2, 12), "must stop at an optimizer-step boundary, mid-run"
    resume = torch.load(run_dir / "checkpoints" / "pretrain_64_resume.pth", weights_only=True)
    assert (resume["epoch"] + 1, resume["step"]) == last_step
    assert set(resume["lit_minimind"]) == {"format", "world_size", "ranks"}  # every rank's RNG, no gradients

    resumed = run_cli(run_dir, args + ["--ckpt_path", "last"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_resumed(resumed, last_step[0], last_step[1] + 1)
    for key, values in {**stopped.steps, **resumed.steps}.items():
        assert values == ref.steps[key]
    ref_w = torch.load(ref_dir / "out" / "pretrain_64.pth", weights_only=True)
    got_w = torch.load(run_dir / "out" / "pretrain_64.pth", weights_only=True)
    assert all(torch.equal(ref_w[k], got_w[k]) for k in ref_w)


def test_second_sigint_aborts_at_once(tmp_path: Path) -> None:
    need_shared()
    # the first SIGINT (sent by the run itself in its first batch, which then waits for the next signal)
    # would finish the optimizer step, save and exit 0; the second, sent once the first is reported, aborts
    wait = ["--trainer.callbacks+=tests.helpers.signal_at.SignalAt", "--trainer.callbacks.phase=on_train_batch_start",
            "--trainer.callbacks.signame=SIGINT", "--trainer.callbacks.then_wait=true"]
    run = run_cli(tmp_path, tiny_args(epochs=2, accumulate=2, save_interval=100) + wait,
                  on_line=at_text("received: finishing", lambda run: run.send(signal.SIGINT)))
    assert "SIGINT received: finishing" in run.stdout, run.stderr[-2000:]
    assert run.returncode == 130, run.stderr[-2000:]
    assert "second SIGINT: aborting now" in run.stdout
    assert not run.steps and not list((tmp_path / "checkpoints").glob("*.ckpt")), "saved or trained on"


@pytest.mark.slow
def test_sigterm_under_ddp_stops_all_ranks_at_the_same_step(tmp_path: Path) -> None:
    need_shared()
    args = tiny_args(epochs=2, accumulate=2, save_interval=100, devices=2)
    stopped = run_cli(tmp_path, args, on_line=at_line(2, lambda run: run.send(signal.SIGTERM)))  # rank 0 only
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    resume = torch.load(tmp_path / "checkpoints" / "pretrain_64_resume.pth", weights_only=True)
    assert resume["world_size"] == 2 and resume["step"] % 2 == 0 and (resume["epoch"], resume["step"]) < (1, 6)
    resumed = run_cli(tmp_path, args + ["--ckpt_path", "last"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_resumed(resumed, resume["epoch"] + 1, resume["step"] + 1)
