"""Kill-anywhere: a run SIGKILLed again and again and resumed with ``--ckpt_path last``
ends bit-identical to the same run never interrupted (weights and per-step losses)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.helpers.runs import (
    assert_resumed,
    assert_same_tensors,
    assert_steps_match,
    cli_env,
    final_state,
    need_shared,
    run_cli,
    run_until_done,
    tiny_args,
)

SCENARIOS = {
    # name: (extra CLI args, moe)
    "accumulate": ([], False),
    "moe": ([], True),
    "workers": (["--data.num_workers", "2"], False),
    "fp16_scaler": (["--trainer.plugins", "lit_minimind.model.precision.CPUFloat16Mixed"], False),
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in ("moe", "workers", "fp16_scaler") else n for n in SCENARIOS])  # make test-slow (budget)
def test_kill_anywhere_resume_is_bit_identical(tmp_path: Path, name: str) -> None:
    need_shared()
    extra, moe = SCENARIOS[name]
    args = tiny_args(*extra, epochs=2, accumulate=2, save_interval=5, moe=moe)
    ref_dir, kill_dir = tmp_path / "ref", tmp_path / "killed"
    ref_dir.mkdir(), kill_dir.mkdir()
    ref = run_cli(ref_dir, args)
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert len(ref.steps) == 24  # 2 epochs x 12 batches

    rng = random.Random(f"kill-{name}")
    runs = run_until_done(kill_dir, args, rng, kills=3, total_lines=24, stem=f"pretrain_64{'_moe' if moe else ''}")
    assert len(runs) >= 2, "no kill happened"
    assert_steps_match(runs, ref)

    ref_weights, ref_resume = final_state(ref_dir, moe)
    weights, resume = final_state(kill_dir, moe)
    assert_same_tensors(weights, ref_weights)
    assert_same_tensors(resume["state_dict"], ref_resume["state_dict"])
    if name == "fp16_scaler":
        assert resume["scaler"]["scale"] == ref_resume["scaler"]["scale"]
        assert ref_resume["scaler"]["_growth_tracker"] == resume["scaler"]["_growth_tracker"]


@pytest.mark.parametrize("file", ["checkpoint", pytest.param("resume", marks=pytest.mark.slow),
                                  pytest.param("export", marks=pytest.mark.slow)])
def test_kill_inside_the_final_save_still_ends_with_final_files(tmp_path: Path, file: str) -> None:
    need_shared()
    args = tiny_args(epochs=2, accumulate=2, save_interval=5)  # saves at 5, 10, 12 per epoch: 6 x 3 writes
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    ref_dir.mkdir(), run_dir.mkdir()
    assert run_cli(ref_dir, args).returncode == 0
    killed = run_cli(run_dir, args + ["--ckpt_path", "last"], env=cli_env(LIT_MINIMIND_TEST_STOP_IN_SAVE=f"6:{file}"))
    assert killed.returncode == -9 and "@@stopped-in-save" in killed.stdout
    done = run_cli(run_dir, args + ["--ckpt_path", "last"])
    assert done.returncode == 0, done.stderr[-3000:]
    # killed in the last (6th) save's checkpoint commit: the step-10 save is the newest; in its _resume.pth or export
    # (the checkpoint in place): nothing left to train
    assert_resumed(done, *{"checkpoint": (2, 11), "resume": (3, 1), "export": (3, 1)}[file])
    ref_weights, ref_resume = final_state(ref_dir, False)
    weights, resume = final_state(run_dir, False)
    assert_same_tensors(weights, ref_weights)
    assert_same_tensors(resume["state_dict"], ref_resume["state_dict"])
    assert (resume["epoch"], resume["step"]) == (1, 12)


@pytest.mark.parametrize("save", ["async", pytest.param("sync", marks=pytest.mark.slow)])
def test_dropout_draws_continue_after_a_resume(tmp_path: Path, save: str) -> None:
    """Dropout draws from the global RNG on every batch: killed right after the step-4 save and resumed,
    the run draws what the uninterrupted one drew (each rank's RNG state is in the checkpoint). Also with
    ``--resume.async_save false`` (saves written in the training thread)."""
    need_shared()
    args = tiny_args(epochs=1, accumulate=2, save_interval=4) + ["--model.dropout", "0.2",
                                                                 f"--resume.async_save={str(save == 'async').lower()}"]
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    ref_dir.mkdir(), run_dir.mkdir()
    ref = run_cli(ref_dir, args)
    assert ref.returncode == 0, ref.stderr[-3000:]
    # killed right after the step-4 save's last file (its export, the 3rd commit)
    killed = run_cli(run_dir, args, env=cli_env(LIT_MINIMIND_TEST_STOP_AFTER_SAVE="1:export"))
    assert killed.returncode == -9 and "@@stopped-after-save" in killed.stdout
    done = run_cli(run_dir, args + ["--ckpt_path", "last"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert_resumed(done, 1, 5)
    assert done.steps == {key: values for key, values in ref.steps.items() if key >= (1, 5)}
    assert_same_tensors(final_state(run_dir, False)[0], final_state(ref_dir, False)[0])
