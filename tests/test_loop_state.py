"""The one hand-built piece of Lightning state (loop counters for a MiniMind file or a changed world
size) equals what Lightning saves itself at the same position."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch

from lit_minimind.resume.internals import fit_loop_state_at
from lit_minimind.resume.states import DataPosition, optimizer_steps
from tests.helpers.runs import need_shared, run_cli, tiny_args


@pytest.mark.parametrize("accumulate", [2, 5])
def test_built_loop_state_equals_lightnings_own(tmp_path: Path, accumulate: int) -> None:
    need_shared()
    run = run_cli(tmp_path, tiny_args(epochs=2, accumulate=accumulate, save_interval=3) + ["--resume.keep_last", "100"])
    assert run.returncode == 0, run.stderr[-3000:]
    template = L.Trainer(logger=False, enable_checkpointing=False).fit_loop.state_dict()
    ckpts = sorted((tmp_path / "checkpoints").glob("*.ckpt"))
    # saves fall due at steps 3, 6, 9 and are taken at their window's optimizer step, plus the epoch end (12):
    # accumulate 2: 4, 6, 10, 12; accumulate 5: 5, 10, 12 (per epoch)
    assert len(ckpts) == (8 if accumulate == 2 else 6)
    for path in ckpts:
        ckpt = torch.load(path, weights_only=True)
        data = ckpt["MiniMindDataModule"]
        position = DataPosition(data["epoch"], data["step"], data["iters"])
        assert ckpt["global_step"] == optimizer_steps(position, accumulate), path.name
        built = fit_loop_state_at(template, position, accumulate, ckpt["global_step"])
        saved = dict(ckpt["loops"]["fit_loop"])
        assert saved.pop("state_dict") == {"combined_loader": [{}]}  # the loader's (empty) state: not built
        built.pop("state_dict")
        assert built == saved, path.name
