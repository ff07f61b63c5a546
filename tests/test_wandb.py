"""wandb (real, offline): a killed and resumed run keeps logging into the same run, by its saved id."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.runs import MINIMIND, ROOT, Run, assert_resumed, cli_env, expected_resume, need_shared, run_cli, tiny_args
from tests.helpers.wandb_files import run_summary

KEYS = ("loss", "logits_loss", "aux_loss", "learning_rate")


def kill_in_save(cwd: Path, args: list[str], commit: str) -> Run:
    """SIGKILL the run (wandb's service too) inside the file commit ``commit`` names (``N:KIND``,
    tests/helpers/faults.py), at once: rows wandb had not written to its run file yet are logged again by
    the resumed run (the checkpoint carries them)."""
    killed = run_cli(cwd, args, env=cli_env(LIT_MINIMIND_TEST_STOP_IN_SAVE=commit))
    assert "@@stopped-in-save" in killed.stdout
    return killed


def wandb_args() -> list[str]:
    return ["--config", str(ROOT / "conf" / "wandb.yaml")]


def test_killed_twice_one_run_id_and_one_clean_history(tmp_path: Path) -> None:
    need_shared()
    args = wandb_args() + tiny_args(epochs=2, accumulate=2, save_interval=4) + ["--ckpt_path", "last"]
    # inside the second save's _resume.pth link (step 8): its checkpoint is in place
    first = kill_in_save(tmp_path, args, "2:resume")
    # resumed after step 8, it first writes step 8's link and export again, then saves at 12 and at epoch 2
    # step 4: killed inside that save's export (its third), its checkpoint in place
    second = kill_in_save(tmp_path, args, "3:export")
    assert first.returncode == second.returncode == -9
    assert_resumed(second, 1, 9)
    assert expected_resume(tmp_path) == (2, 5)
    final = run_cli(tmp_path, args)
    assert final.returncode == 0, final.stderr[-3000:]
    assert_resumed(final, 2, 5)
    runs = [run_summary(d) for d in sorted((tmp_path / "wandb").glob("offline-run-*"))]
    assert len(runs) == 3
    assert len({r["id"] for r in runs}) == 1, "a resumed run must continue the same wandb run"
    assert "wandb: continuing run" in final.stderr

    by_step: dict[int, dict] = {}
    for run in runs:
        for row in run["history"]:
            if "micro_step" not in row or "loss" not in row:  # e.g. the epoch-end row (mean_loss)
                continue
            values = {k: row[k] for k in KEYS}
            step = int(row["micro_step"])
            assert by_step.setdefault(step, values) == values, f"step {step} re-logged with other values"
    assert sorted(by_step) == list(range(1, 25)), "every micro-batch of both epochs is in the history"
    # hyperparameters: logged by every start; a run SIGKILLed before wandb wrote its config record has none
    assert runs[-1]["config"].get("hidden_size") == 64, [sorted(r["config"]) for r in runs]
    assert all(r["config"]["hidden_size"] == 64 for r in runs if "hidden_size" in r["config"])
    # every resume is in the config of the last run (each start sends all of them: a killed process's
    # config record may never have reached its file)
    resumes = sorted(k for k in runs[-1]["config"] if k.startswith("resume_at_global_step_"))
    assert len(resumes) == 2, [sorted(r["config"]) for r in runs]
    saved = torch.load(tmp_path / "checkpoints" / "pretrain_64_resume.pth", weights_only=True)
    assert saved["wandb_id"] == runs[0]["id"]


def test_minimind_file_without_wandb_id_starts_new_run_and_stores_it(tmp_path: Path) -> None:
    need_shared()
    src = MINIMIND / "original_run" / "checkpoints__pretrain_64_resume.step5.pth"
    assert torch.load(src, weights_only=True)["wandb_id"] is None
    run = run_cli(tmp_path, wandb_args() + tiny_args() + ["--ckpt_path", str(src)])
    assert run.returncode == 0, run.stderr[-3000:]
    assert "the checkpoint has no wandb run id: starting a new run" in run.stderr
    assert_resumed(run, 1, 6)
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    new_id = run_summary(run_dir)["id"]
    assert new_id
    saved = torch.load(tmp_path / "checkpoints" / "pretrain_64_resume.pth", weights_only=True)
    assert saved["wandb_id"] == new_id
    ckpt = torch.load(next((tmp_path / "checkpoints").glob("*.ckpt")), weights_only=True)
    assert ckpt["callbacks"]["ResumeCallback"]["wandb_id"] == new_id


@pytest.mark.slow  # make test's budget: 14.6 min on a clean clone, 2026-12-03 (make test-slow)
def test_without_credentials_wandb_logs_offline(tmp_path: Path) -> None:
    """No ``WANDB_MODE``, no API key, no ~/.netrc: the run logs offline under wandb/ (conf/wandb.yaml's promise)."""
    need_shared()
    env = {k: v for k, v in cli_env().items() if not k.startswith("WANDB_")}
    env.update(HOME=str(tmp_path / "home"), NETRC=str(tmp_path / "home" / ".netrc"))  # no credentials anywhere
    (tmp_path / "home").mkdir()
    run = run_cli(tmp_path, wandb_args() + tiny_args("--trainer.max_steps", "1"), env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    summary = run_summary(run_dir)
    assert summary["id"] and [row["micro_step"] for row in summary["history"] if "loss" in row] == [1, 2]


@pytest.mark.slow
def test_an_id_the_user_chose_wins_over_the_checkpoints(tmp_path: Path) -> None:
    need_shared()
    args = wandb_args() + tiny_args(save_interval=2)
    first = run_cli(tmp_path, args + ["--trainer.max_steps", "1"])
    assert first.returncode == 0, first.stderr[-3000:]
    saved = torch.load(tmp_path / "checkpoints" / "pretrain_64_resume.pth", weights_only=True)["wandb_id"]
    assert saved
    chosen = run_cli(tmp_path, args + ["--trainer.max_steps", "2", "--ckpt_path", "last",
                                       "--trainer.logger.init_args.id", "mychosen1"])
    assert chosen.returncode == 0, chosen.stderr[-3000:]
    assert_resumed(chosen, 1, 3)
    assert f"wandb: logging to the run id you chose (mychosen1), not the checkpoint's ({saved})" in chosen.stderr
    ids = sorted(run_summary(d)["id"] for d in (tmp_path / "wandb").glob("offline-run-*"))
    assert ids == sorted([saved, "mychosen1"])


@pytest.mark.slow
def test_ddp_run_logs_from_rank_zero_into_one_run_across_a_kill(tmp_path: Path) -> None:
    """2 processes: one wandb run (rank 0's), not one per rank; killed after a commit and resumed on
    2 processes, it continues that run, and each optimizer step is logged once with one value."""
    need_shared()
    args = wandb_args() + tiny_args(epochs=1, save_interval=3, devices=2) + ["--ckpt_path", "last"]
    # 3 file commits a save: the 3rd is the export of the save due at step 3, taken at step 4
    killed = run_cli(tmp_path, args, env=cli_env(LIT_MINIMIND_TEST_STOP_AFTER_SAVE="1:export"))
    assert killed.returncode == -9 and "@@stopped-after-save" in killed.stdout
    resumed = run_cli(tmp_path, args)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_resumed(resumed, 1, 5)
    runs = [run_summary(d) for d in sorted((tmp_path / "wandb").glob("offline-run-*"))]
    assert len(runs) == 2, "one wandb run per start (rank 0's), never one per rank"
    assert runs[0]["id"] == runs[1]["id"]
    saved = torch.load(tmp_path / "checkpoints" / "pretrain_64_resume.pth", weights_only=True)
    assert saved["wandb_id"] == runs[0]["id"] and saved["world_size"] == 2
    logged: dict[int, float] = {}
    for run in runs:
        for row in run["history"]:
            if "micro_step" in row and "loss" in row:
                assert logged.setdefault(int(row["micro_step"]), row["loss"]) == row["loss"]
    assert sorted(logged) == list(range(1, 7)), "6 batches per rank, each logged once"
