"""wandb (real, offline): a killed and resumed run keeps logging into the same run, by its saved id."""

from __future__ import annotations

from pathlib import Path

import torch
from conftest import MINIMIND, ROOT, cli_env, need_shared, run_cli, tiny_args
from wandb_files import run_summary

KEYS = ("loss", "logits_loss", "aux_loss", "learning_rate")


def kill_in_save(cwd: Path, args: list[str], save_number: int) -> int:
    """SIGKILL the run (wandb's service too) inside its ``save_number``-th file write, at once: rows
    wandb had not written to its run file yet are logged again by the resumed run (the checkpoint
    carries them)."""
    killed = run_cli(cwd, args, env=cli_env(LIT_MINIMIND_TEST_STOP_IN_SAVE=str(save_number)))
    assert "@@stopped-in-save" in killed.stdout
    return killed.returncode


def wandb_args() -> list[str]:
    return ["--config", str(ROOT / "conf" / "wandb.yaml")]


def test_killed_twice_one_run_id_and_one_clean_history(tmp_path: Path) -> None:
    need_shared()
    args = wandb_args() + tiny_args(epochs=2, accumulate=2, save_interval=4) + ["--ckpt_path", "last"]
    first = kill_in_save(tmp_path, args, save_number=5)   # inside the save at epoch 1 step 8
    second = kill_in_save(tmp_path, args, save_number=8)  # resumed at step 4 -> inside epoch 2 step 4's save
    assert first == second == -9
    final = run_cli(tmp_path, args)
    assert final.returncode == 0, final.stderr[-3000:]
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
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    new_id = run_summary(run_dir)["id"]
    assert new_id
    saved = torch.load(tmp_path / "checkpoints" / "pretrain_64_resume.pth", weights_only=True)
    assert saved["wandb_id"] == new_id
    ckpt = torch.load(next((tmp_path / "checkpoints").glob("*.ckpt")), weights_only=True)
    assert ckpt["callbacks"]["ResumeCallback"]["wandb_id"] == new_id
