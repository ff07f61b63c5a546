"""Interop with original MiniMind: resume from its files, and our export loads into its model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.runs import MINIMIND, assert_resumed, need_shared, run_cli, tiny_args


@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_resume_from_original_minimind_file_reproduces_its_resumed_run(tmp_path: Path, variant: str) -> None:
    need_shared()
    moe = variant == "moe"
    suffix = "_moe" if moe else ""
    src = MINIMIND / "original_run" / f"checkpoints__pretrain_64{suffix}_resume.step5.pth"
    # --from_weight beside an explicit checkpoint: ignored, said so (the steps below are the resumed run's)
    weights = MINIMIND / "original_run" / f"out__pretrain_64{suffix}.pth"
    run = run_cli(tmp_path, tiny_args(epochs=1, accumulate=2, save_interval=5, moe=moe) + ["--ckpt_path", str(src),
                  "--from_weight", str(weights), "--trainer.callbacks+=tests.helpers.init_draws.InitDraws"])
    assert run.returncode == 0, run.stderr[-3000:]
    # a MiniMind file holds no RNG state: the model is initialised first (its draws), as MiniMind's resume does
    assert json.loads((tmp_path / "init_draws.json").read_text())["drew"]
    assert f"--from_weight {weights} ignored: --ckpt_path {src} is given" in run.stderr
    assert_resumed(run, 1, 6)
    expected = json.loads((MINIMIND / "original_run" / "runs.json").read_text())[f"{variant}_resumed"]["steps"]
    got = run.steps
    assert sorted(got) == [(1, s["step"]) for s in expected]
    for s in expected:
        loss, logits_loss, aux_loss, lr = (float(x) for x in got[(1, s["step"])])
        assert abs(loss - s["loss"]) <= 2e-4, (s["step"], loss, s["loss"])
        assert abs(aux_loss - s["aux_loss"]) <= 2e-4
        assert abs(lr - s["lr"]) <= 1e-8

    # our files keep MiniMind's layout and load into MiniMind's model strictly
    keys_txt = (MINIMIND / "parity" / f"{variant}_state_dict_keys.txt").read_text().splitlines()
    listing = [line.split("\t") for line in keys_txt if line.strip()]
    export = torch.load(tmp_path / "out" / f"pretrain_64{suffix}.pth", weights_only=True)
    assert list(export) == [name for name, _, _ in listing]
    for name, shape, _dtype in listing:
        assert tuple(export[name].shape) == tuple(json.loads(shape.replace("(", "[").replace(",)", "]").replace(")", "]")))
        assert export[name].dtype == torch.float16
    resume = torch.load(tmp_path / "checkpoints" / f"pretrain_64{suffix}_resume.pth", weights_only=True)
    for key in ("model", "optimizer", "epoch", "step", "world_size", "wandb_id"):
        assert key in resume
    assert resume["epoch"] == 0 and resume["step"] == 12 and resume["world_size"] == 1

    from lit_minimind.model import MiniMindConfig, MiniMindForCausalLM

    config = MiniMindConfig.from_dict(json.loads((MINIMIND / "parity" / f"{variant}_config.json").read_text()))
    model = MiniMindForCausalLM(config)
    # what MiniMind's train_pretrain.py does with a resume file (--from_resume 1)
    model.load_state_dict(resume["model"], strict=True)
    torch.optim.AdamW(model.parameters(), lr=5e-4).load_state_dict(resume["optimizer"])
    # MiniMind's GradScaler(enabled=(dtype == "float16")): disabled in float32, whose state is empty,
    # exactly what a disabled scaler saves (an enabled one would refuse it; see test_precision_resume)
    assert resume["scaler"] == torch.amp.GradScaler("cpu", enabled=False).state_dict() == {}
    torch.amp.GradScaler("cpu", enabled=False).load_state_dict(resume["scaler"])
    assert resume.get("step", 0) == 12 and resume["epoch"] == 0
    original = torch.load(MINIMIND / "original_run" / f"out__pretrain_64{suffix}.pth", weights_only=True)
    assert original.keys() == export.keys()
