"""Promises of the README with no other test: a ``max_time`` stop saves where it stopped and resumes
there exactly; ``--from_weight`` takes the weights of a Lightning ``.ckpt`` or a ``_resume.pth`` (fresh
optimizer and position)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.runs import assert_resumed, need_shared, run_cli, tiny_args


@pytest.mark.slow
def test_a_max_time_stop_saves_where_it_stopped_and_resumes_there(tmp_path: Path) -> None:
    need_shared()
    args = tiny_args(epochs=40, accumulate=2, save_interval=1000)  # far longer than the time limit
    stopped = run_cli(tmp_path, args + ["--trainer.max_time", "00:00:00:06"])
    assert stopped.returncode == 0, stopped.stderr[-2000:]
    (epoch, _, step, _) = (int(x) for x in stopped.lines[-1][:4])  # the last batch trained before the limit
    assert epoch < 40, "the time limit stopped the run"
    saved = sorted((tmp_path / "checkpoints").glob("*.ckpt"))
    assert saved, "a max_time stop writes a checkpoint"
    ckpt = torch.load(max(saved, key=lambda p: p.stat().st_mtime_ns), weights_only=True)
    # stops land on an optimizer-step boundary: the checkpoint is at the last trained batch or the window's end
    assert (int(ckpt["epoch"]) + 1, int(ckpt["step"])) in {(epoch, step), (epoch, step - step % 2)}
    resumed = run_cli(tmp_path, args + ["--trainer.max_time", "00:00:00:02", "--ckpt_path", "last"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    next_epoch, next_step = ((int(ckpt["epoch"]) + 2, 1) if int(ckpt["step"]) >= 12
                             else (int(ckpt["epoch"]) + 1, int(ckpt["step"]) + 1))
    assert_resumed(resumed, next_epoch, next_step)


@pytest.mark.parametrize("source", [pytest.param("ckpt", marks=pytest.mark.slow), pytest.param("resume_pth", marks=pytest.mark.slow)])
def test_from_weight_takes_a_checkpoints_weights_with_a_fresh_start(tmp_path: Path, source: str) -> None:
    need_shared()
    first_dir, second_dir = tmp_path / "first", tmp_path / "second"
    first_dir.mkdir(), second_dir.mkdir()
    first = run_cli(first_dir, tiny_args(save_interval=4) + ["--trainer.max_steps", "2"])
    assert first.returncode == 0, first.stderr[-2000:]
    (ckpt,) = (first_dir / "checkpoints").glob("*.ckpt")
    path = ckpt if source == "ckpt" else first_dir / "checkpoints" / "pretrain_64_resume.pth"
    run = run_cli(second_dir, tiny_args(save_interval=100) + ["--from_weight", str(path), "--trainer.max_steps", "1"])
    assert run.returncode == 0, run.stderr[-2000:]
    assert f"{path}" in run.stdout and "resuming" not in run.stderr, "weights loaded, no resume"
    assert min(run.steps) == (1, 1), "a fresh position: the first batch of the first epoch"
    # the first step's loss is the checkpoint's model on batch 1, not a random initialisation's
    fresh = run_cli(tmp_path, tiny_args(save_interval=100) + ["--trainer.max_steps", "1"])
    assert fresh.returncode == 0 and run.steps[(1, 1)][0] != fresh.steps[(1, 1)][0]
