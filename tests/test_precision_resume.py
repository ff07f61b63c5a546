"""The GradScaler across resumes (the scale is restored from every format), deterministic kernels, and
saves held to optimizer-step boundaries."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers.runs import assert_resumed, need_shared, run_cli, tiny_args

FP16 = ["--trainer.plugins", "lit_minimind.model.precision.CPUFloat16Mixed"]
MOVING_SCALE = FP16 + ["--trainer.plugins.init_scale", "1e12"]  # overflows: the scaler backs off every step


def only(run_dir: Path, pattern: str) -> Path:
    found = list((run_dir / "checkpoints").glob(pattern))
    assert len(found) == 1, (pattern, found)
    return found[0]


def test_deterministic_kernels_are_on_by_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    need_shared()
    monkeypatch.chdir(tmp_path)  # the in-process run below writes LightningCLI's config.yaml into the cwd
    run = run_cli(tmp_path, tiny_args(epochs=1) + ["--trainer.max_steps", "1", "--print_config"])
    assert run.returncode == 0, run.stderr[-2000:]
    assert "  deterministic: true\n" in run.stdout
    from lit_minimind.cli.fit import main

    assert main(tiny_args(epochs=1) + ["--trainer.max_steps", "1", "--resume.ckpt_dir", str(tmp_path / "c"),
                                       "--resume.out_dir", str(tmp_path / "o"), "--trainer.logger", "false"]) == 0
    try:
        assert torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("source", ["ckpt", pytest.param("minimind_resume", marks=pytest.mark.slow)])
def test_moved_scale_is_restored(tmp_path: Path, source: str) -> None:
    need_shared()
    args = tiny_args(epochs=1, accumulate=2, save_interval=2) + MOVING_SCALE + ["--resume.keep_last", "100"]
    (tmp_path / "ref").mkdir()
    ref = run_cli(tmp_path / "ref", args)
    assert ref.returncode == 0, ref.stderr[-2000:]
    saved = {int(p.name.split("_s")[1].split("_")[0]): torch.load(p, weights_only=True)
             for p in (tmp_path / "ref" / "checkpoints").glob("*.ckpt")}
    assert saved[4]["scaler"]["scale"] < 1e12 and saved[6]["scaler"]["scale"] < saved[4]["scaler"]["scale"]
    # MiniMind's float16 loader: an enabled GradScaler takes the _resume.pth's scaler state
    minimind = torch.load(tmp_path / "ref" / "checkpoints" / "pretrain_64_resume.pth", weights_only=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
    scaler.load_state_dict(minimind["scaler"])
    last = max(saved)
    assert scaler.get_scale() == saved[last]["scaler"]["scale"] < 1e12 and minimind["step"] == last

    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    ckpt4 = saved[4]
    if source == "ckpt":
        resume_from = run_dir / "checkpoints" / "from.ckpt"
        shutil.copy(only(tmp_path / "ref", "*_e0_s4_*.ckpt"), resume_from)
    else:  # what original MiniMind writes: its keys only, the scaler under "scaler"
        resume_from = run_dir / "checkpoints" / "pretrain_64_resume.pth"
        torch.save({k: ckpt4[k] for k in ("model", "optimizer", "epoch", "step", "world_size", "wandb_id", "scaler")},
                   resume_from)
    resumed = run_cli(run_dir, args + ["--ckpt_path", str(resume_from), "--trainer.max_steps", "3"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert_resumed(resumed, 1, 5)
    assert sorted(resumed.steps) == [(1, 5), (1, 6)]  # one optimizer step: global step 2 -> 3
    after = torch.load(only(run_dir, "*_e0_s6_*.ckpt"), weights_only=True)
    assert after["scaler"]["scale"] == saved[6]["scaler"]["scale"], "the scale was not restored"


@pytest.mark.slow
def test_saves_wait_for_the_window_s_optimizer_step_and_a_minimind_mid_window_file_says_what_it_lacks(
        tmp_path: Path) -> None:
    """save_interval 1 under 2-batch accumulation: every save is taken at an optimizer-step boundary (no
    checkpoint holds half a window); an original MiniMind file saved mid-window (step 5) still resumes,
    with one line saying its partial gradient is not there (as in MiniMind's own resume)."""
    need_shared()
    args = tiny_args(epochs=1, accumulate=2, save_interval=1) + ["--resume.keep_last", "100"]
    (tmp_path / "ref").mkdir()
    ref = run_cli(tmp_path / "ref", args + FP16)
    assert ref.returncode == 0, ref.stderr[-2000:]
    steps = sorted(int(p.name.split("_s")[1].split("_")[0]) for p in (tmp_path / "ref" / "checkpoints").glob("*.ckpt"))
    assert steps == [2, 4, 6, 8, 10, 12]
    step4 = torch.load(only(tmp_path / "ref", "*_e0_s4_*.ckpt"), weights_only=True)
    assert set(step4["lit_minimind"]) == {"format", "world_size", "ranks"}  # RNG only: nothing half-accumulated

    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    minimind = {k: step4[k] for k in ("model", "optimizer", "world_size", "wandb_id", "scaler")}
    torch.save({**minimind, "epoch": 0, "step": 5}, run_dir / "checkpoints" / "pretrain_64_resume.pth")
    resumed = run_cli(run_dir, args + FP16 + ["--ckpt_path", "last"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert_resumed(resumed, 1, 6)
    assert resumed.stderr.count("holds no partial gradients") == 1, resumed.stderr[-2000:]
