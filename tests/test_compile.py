"""``--model.compile true`` (MiniMind's ``--use_compile 1``): MiniMind's keys in every file, exact resume."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.runs import assert_resumed, cli_env, need_shared, run_cli, tiny_args

pytestmark = pytest.mark.slow  # torch.compile on CPU takes a minute per process: `make test-slow`


def test_compiled_run_resumes_exactly_with_minimind_keys(tmp_path: Path) -> None:
    need_shared()
    env = cli_env(TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))  # later processes reuse the kernels
    args = tiny_args(epochs=1, accumulate=2, save_interval=5) + ["--model.compile", "true"]
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    ref_dir.mkdir(), run_dir.mkdir()
    ref = run_cli(ref_dir, args, env=env, timeout=900)
    assert ref.returncode == 0, ref.stderr[-3000:]
    # killed right after the step-6 save's last file (its export, the 3rd commit; the save fell due at 5)
    killed = run_cli(run_dir, args, env={**env, "LIT_MINIMIND_TEST_STOP_AFTER_SAVE": "1:export"}, timeout=900)
    assert killed.returncode == -9 and "@@stopped-after-save" in killed.stdout
    done = run_cli(run_dir, args + ["--ckpt_path", "last"], env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_resumed(done, 1, 7)
    assert done.steps == {key: values for key, values in ref.steps.items() if key >= (1, 7)}
    ref_w = torch.load(ref_dir / "out" / "pretrain_64.pth", weights_only=True)
    got_w = torch.load(run_dir / "out" / "pretrain_64.pth", weights_only=True)
    assert not any("_orig_mod" in k for k in got_w) and got_w.keys() == ref_w.keys()
    assert all(torch.equal(ref_w[k], got_w[k]) for k in ref_w)
    resume = torch.load(run_dir / "checkpoints" / "pretrain_64_resume.pth", weights_only=True)
    assert not any("_orig_mod" in k for k in resume["state_dict"]) and resume["model"].keys() == ref_w.keys()
