"""Kill chains: a run SIGKILLed again and again - right after an epoch-end save, inside and after
mid-epoch saves, in teardown after its final save - ends exactly like the run never interrupted."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
import torch

from tests.helpers.faults import SAVE_FILES
from tests.helpers.runs import TINY_JSONL, assert_resumed, cli_env, expected_resume, need_shared, resumed_at, run_cli, tiny_args


def doubled_data(tmp_path: Path) -> Path:
    """96 records: 24 batches of 4 per epoch."""
    path = tmp_path / "data96.jsonl"
    path.write_text(TINY_JSONL.read_text() * 2)
    return path


def final_weights(run_dir: Path) -> tuple[dict, dict]:
    export = torch.load(run_dir / "out" / "pretrain_64.pth", weights_only=True)
    resume = torch.load(run_dir / "checkpoints" / "pretrain_64_resume.pth", weights_only=True)
    return export, resume["state_dict"]


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs"


def resume_last(run_dir: Path, args: list[str], iters: int, **kwargs):
    """``--ckpt_path last``; the process resumes where the checkpoint ``last`` names before it starts."""
    want = expected_resume(run_dir, iters=iters)
    run = run_cli(run_dir, args + ["--ckpt_path", "last"], **kwargs)
    if want is None:
        assert resumed_at(run) is None and (not run.steps or min(run.steps) == (1, 1)), run.stderr[-2000:]
    elif resumed_at(run) is not None or run.returncode != -9:  # a kill may come before the resume line
        assert_resumed(run, *want)
    return run


def chain(run_dir: Path, args: list[str], stops: list[tuple[str, str]], iters: int = 24) -> list:
    """One process per stop: SIGKILLed in or right after the commit it names (``N:KIND``); then one to finish.
    Each process after a save resumes where its checkpoint says."""
    runs = []
    for moment, commit in stops:
        env = cli_env(**{f"LIT_MINIMIND_TEST_STOP_{moment.upper()}_SAVE": commit})
        run = resume_last(run_dir, args, iters, env=env)
        runs.append(run)
        if run.returncode == 0:
            break
        assert run.returncode == -9, run.stderr[-3000:]
    final = resume_last(run_dir, args, iters)
    assert final.returncode == 0, final.stderr[-3000:]
    assert resumed_at(final) is not None, "the last process did not resume"
    return runs + [final]


@pytest.mark.slow  # half a minute (make test-slow; keeps make test under its budget)
def test_resumes_at_epoch_boundaries_move_forward(tmp_path: Path) -> None:
    """Saves only at epoch ends; each process is killed right after its first checkpoint commit."""
    need_shared()
    args = tiny_args(epochs=4, accumulate=2, save_interval=1000) + ["--data.data_path", str(doubled_data(tmp_path))]
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    ref_dir.mkdir(), run_dir.mkdir()
    ref = run_cli(ref_dir, args)
    assert ref.returncode == 0, ref.stderr[-3000:]
    runs = chain(run_dir, args, [("after", "1:checkpoint")] * 4)
    assert resumed_at(runs[0]) is None
    for epoch, run in enumerate(runs[1:], start=2):  # each process resumes after the previous one's epoch
        assert_resumed(run, epoch, 1)
    assert "global steps" in runs[-1].stdout
    for run in runs:
        for key, values in run.steps.items():
            assert values == ref.steps[key], key
    assert_same(final_weights(run_dir)[0], final_weights(ref_dir)[0])
    assert_same(final_weights(run_dir)[1], final_weights(ref_dir)[1])
    ckpts = [p.name for p in (run_dir / "checkpoints").glob("*_e3_s24_*.ckpt")]
    assert len(ckpts) == 1, f"the last epoch was saved more than once: {ckpts}"


@pytest.mark.slow  # 40 s a seed (make test-slow; make test keeps the teardown and best-checkpoint chains)
@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.matrix)])  # seed 1: make test-matrix
def test_mid_epoch_kill_chain_is_exact(tmp_path: Path, seed: int) -> None:
    """save_interval 7 against accumulation 2: saves mid-window and at epoch ends; kills inside
    and right after random commits, six times."""
    need_shared()
    args = tiny_args(epochs=4, accumulate=2, save_interval=7) + ["--data.data_path", str(doubled_data(tmp_path))]
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    ref_dir.mkdir(), run_dir.mkdir()
    ref = run_cli(ref_dir, args)
    assert ref.returncode == 0, ref.stderr[-3000:]
    rng = random.Random(seed)
    stops = [(rng.choice(["in", "after"]), f"{rng.randint(1, 3)}:{rng.choice(SAVE_FILES)}") for _ in range(6)]
    runs = chain(run_dir, args, stops)
    positions = [m for r in runs[1:] for m in re.findall(r"resuming (?:epoch (\d+) at step (\d+)|at the start of epoch (\d+))",
                                                          r.stderr + r.stdout)]
    order = [(int(e or s), int(k or 1)) for e, k, s in positions]
    assert order == sorted(order), f"a resume went backwards: {order}"
    seen = {}
    for run in runs:
        for key, values in run.steps.items():
            assert values == ref.steps[key], key
            seen[key] = values
    assert seen.keys() == ref.steps.keys()
    assert_same(final_weights(run_dir)[0], final_weights(ref_dir)[0])
    assert_same(final_weights(run_dir)[1], final_weights(ref_dir)[1])


@pytest.mark.slow  # make test-slow (budget)
def test_kill_in_teardown_after_the_final_save_trains_nothing_again(tmp_path: Path) -> None:
    need_shared()
    args = tiny_args(epochs=2, accumulate=2, save_interval=100)  # saves at the two epoch ends
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    ref_dir.mkdir(), run_dir.mkdir()
    assert run_cli(ref_dir, args).returncode == 0
    runs = chain(run_dir, args, [("after", "2:export")], iters=12)  # after the final export: in teardown
    assert runs[0].returncode == -9 and len(runs[0].steps) == 24
    assert_resumed(runs[1], 3, 1)  # past the last epoch: nothing to train
    assert runs[1].steps == {}, "a finished run trained again after its resume"
    assert "global steps: 12" in runs[1].stdout
    assert_same(final_weights(run_dir)[0], final_weights(ref_dir)[0])
    assert len(list((run_dir / "checkpoints").glob("*_e1_s12_*.ckpt"))) == 1


@pytest.mark.slow  # make test-slow: keeps make test under its budget
def test_best_checkpoint_records_its_own_position(tmp_path: Path) -> None:
    """``{stem}_best.ckpt`` is written at validation (after batch 6), between saves (4, 8): resuming from
    it continues after batch 6, exactly."""
    need_shared()
    args = tiny_args(epochs=2, accumulate=2, save_interval=4) + [
        "--data.val_fraction", "0.1", "--trainer.val_check_interval", "6", "--trainer.num_sanity_val_steps", "0"]
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    ref_dir.mkdir(), run_dir.mkdir()
    ref = run_cli(ref_dir, args)
    assert ref.returncode == 0, ref.stderr[-3000:]
    killed = run_cli(run_dir, args, env=cli_env(LIT_MINIMIND_TEST_STOP_AFTER_SAVE="1:best"))
    assert killed.returncode == -9 and max(killed.steps) >= (1, 6)  # async: training runs on while it is written
    best = torch.load(run_dir / "checkpoints" / "pretrain_64_best.ckpt", weights_only=True)
    assert (best["epoch"], best["step"], best["MiniMindDataModule"]["step"]) == (0, 6, 6)
    resumed = run_cli(run_dir, args + ["--ckpt_path", "checkpoints/pretrain_64_best.ckpt"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_resumed(resumed, 1, 7)
    for key, values in resumed.steps.items():
        assert values == ref.steps[key], key
    assert_same(final_weights(run_dir)[0], final_weights(ref_dir)[0])
