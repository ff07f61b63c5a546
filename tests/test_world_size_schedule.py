"""A resume on another world size with ``--trainer.max_steps`` keeps one LR schedule: max_steps counts
optimizer steps of the current world size (the saved global step is translated, and the run says so
once), so the LR never rises after the schedule's minimum and training ends where the schedule does."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.runs import need_shared, run_cli, tiny_args

LR = 5e-4  # tiny_args' --model.learning_rate; MiniMind's rule ends at 0.1 x LR


def config(devices: int, max_steps: int) -> list[str]:
    # 3 epochs of 12 batches on 1 process (6 on 2); max_steps stops training first, mid epoch 3
    return tiny_args("--trainer.max_steps", str(max_steps), epochs=3, accumulate=2, save_interval=2, devices=devices)


def lrs(run) -> list[float]:
    return [float(values[3]) for _, values in sorted(run.steps.items())]


@pytest.mark.slow
@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2)])
def test_resume_on_another_world_size_keeps_one_lr_schedule(tmp_path: Path, before: int, after: int) -> None:
    need_shared()
    steps = {1: 14, 2: 7}  # the same training on either world size: 14 x 2 x 4 x 1 = 7 x 2 x 4 x 2 samples
    first = run_cli(tmp_path, config(before, steps[before]), kill_after_lines=5)
    assert first.returncode == -9
    resumed = run_cli(tmp_path, config(after, steps[after]) + ["--ckpt_path", "last"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    told = [line for line in resumed.stderr.splitlines() if "--trainer.max_steps" in line and "counts optimizer steps" in line]
    assert len(told) == 1, resumed.stderr[-3000:]
    assert f"of {after} process(es): training and its LR schedule end at step {steps[after]}" in told[0]

    seen = lrs(resumed)
    assert seen and all(b <= a for a, b in zip(seen, seen[1:])), f"the LR rose again: {seen}"
    assert seen[-1] == pytest.approx(0.1 * LR, abs=1e-8), "training did not end where the schedule does"
    ckpts = sorted((tmp_path / "checkpoints").glob(f"pretrain_64_e*_g{steps[after]}_*.ckpt"))
    assert ckpts, "no checkpoint at the step limit"
    # the resumed run ends at the same point of the data as an uninterrupted run on the new world size
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    ref = run_cli(ref_dir, config(after, steps[after]))
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert max(resumed.steps) == max(ref.steps)
    assert lrs(ref)[-len(seen):] == seen
