"""The docs' "In your own Lightning script" block (docs/own-script.md), run as it is: ``ResumeCallback`` in a plain
``Trainer`` with ``trainer.fit(..., ckpt_path="last")``, no CLI. Killed mid-epoch and rerun, it resumes
where the checkpoint is, continues its CSV log directory, and ends with the uninterrupted run's losses
and weights; under DDP too; a checkpoint plugin of the user's is refused at setup with one line."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.runs import (
    TINY_JSONL,
    TOKENIZER,
    Run,
    assert_resumed,
    cli_env,
    expected_resume,
    need_shared,
    readme_script,
    run_cli,
)


def write_script(run_dir: Path, *, replace: tuple | None = None) -> list[str]:
    """The docs' script in ``run_dir``; ``replace``: one (old, new) edit or a tuple of them."""
    run_dir.mkdir(parents=True, exist_ok=True)
    edits = () if replace is None else replace if isinstance(replace[0], tuple) else (replace,)
    (run_dir / "train.py").write_text(readme_script(*edits))
    return [sys.executable, "train.py"]


def run_script(run_dir: Path, *, kill_after_lines: int | None = None, replace: tuple | None = None,
               **env: str) -> Run:
    return run_cli(run_dir, [str(TINY_JSONL), str(TOKENIZER)], command=write_script(run_dir, replace=replace),
                   kill_after_lines=kill_after_lines, env=cli_env(**env))


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoints" / "pretrain_64_resume.pth", weights_only=True)["state_dict"]


def assert_same_run(ref: Run, ref_dir: Path, runs: list[Run], run_dir: Path) -> None:
    seen = {}
    for run in runs:
        for key, values in run.steps.items():
            assert values == ref.steps[key], f"step {key}: {values} != uninterrupted {ref.steps[key]}"
            seen[key] = values
    assert seen.keys() == ref.steps.keys(), "some steps were never trained"
    a, b = final_weights(ref_dir), final_weights(run_dir)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "final weights differ"
    export_a, export_b = (torch.load(d / "out" / "pretrain_64.pth", weights_only=True) for d in (ref_dir, run_dir))
    assert all(torch.equal(export_a[k], export_b[k]) for k in export_a)


@pytest.mark.slow
def test_own_script_killed_and_rerun_resumes_exactly(tmp_path: Path) -> None:
    need_shared()
    ref = run_script(tmp_path / "ref")
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert len(ref.steps) == 12 and "no checkpoint for pretrain_64" in ref.stderr  # a fresh start, said
    assert "there is no last checkpoint available" not in ref.stderr  # ... once, not Lightning's line too

    run_dir = tmp_path / "killed"
    first = run_script(run_dir, kill_after_lines=8)  # saves at steps 5 (mid-window: accumulate 2) and 10
    assert first.returncode == -9
    want = expected_resume(run_dir, "pretrain_64")
    assert want is not None, "nothing was saved before the kill"
    second = run_script(run_dir)
    assert second.returncode == 0, second.stderr[-3000:]
    assert_resumed(second, *want)
    assert_same_run(ref, tmp_path / "ref", [first, second], run_dir)
    # the CSVLogger Lightning made continued the killed run's version directory
    assert sorted(p.name for p in (run_dir / "lightning_logs").iterdir()) == ["version_0"]
    assert "logs: continuing" in second.stderr

    again = run_script(run_dir)  # finished: resumes at the end, trains nothing
    assert again.returncode == 0 and again.steps == {}, again.stderr[-3000:]
    assert "Restored all states" in again.stderr


def test_own_script_shows_the_run_not_lightnings_notices(tmp_path: Path) -> None:
    """The docs' script, as a user runs it: MiniMind's lines and the 1-based bar, none of Lightning's notices that
    say nothing about the run (GPU/TPU lines, its tips, the tensorboardX notice, ``Total Flops: 0``, a 0-based
    ``Epoch 0`` bar beside ``Epoch:[1/1]``); Lightning's own restore and stop lines stay."""
    need_shared()
    run = run_script(tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    shown = run.stdout + run.stderr
    assert len(run.steps) == 12 and "`Trainer.fit` stopped: `max_epochs=1` reached." in shown
    for notice in ("GPU available", "TPU available", "Tip:", "tensorboardX", "Total Flops", "FLOPs", "Epoch 0",
                   "LeafSpec", "smaller than the logging interval"):
        assert notice not in shown, (notice, shown[-3000:])
    assert "Total params" in shown  # the model summary itself stays


def test_own_checkpoint_plugin_is_refused_at_setup(tmp_path: Path) -> None:
    need_shared()
    run = run_script(tmp_path, replace=("callbacks=[ResumeCallback", "plugins=[L.pytorch.plugins.AsyncCheckpointIO()], "
                                        "callbacks=[ResumeCallback"))
    assert run.returncode != 0 and run.steps == {}
    assert "but the Trainer has AsyncCheckpointIO as its checkpoint plugin" in run.stderr
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.slow
def test_own_script_under_ddp_killed_and_rerun_resumes_exactly(tmp_path: Path) -> None:
    need_shared()
    # 6 batches per rank: save_interval 4 (a window's end) saves mid-epoch
    ddp = (('accelerator="cpu"', 'accelerator="cpu", devices=2, strategy="ddp"'),
           ("ResumeCallback(save_interval=5)", "ResumeCallback(save_interval=4)"))
    ref = run_script(tmp_path / "ref", replace=ddp)
    assert ref.returncode == 0, ref.stderr[-3000:]
    run_dir = tmp_path / "killed"
    # killed (both ranks) once the step-4 save's first MiniMind file is committed
    first = run_script(run_dir, replace=ddp, LIT_MINIMIND_TEST_STOP_AFTER_SAVE="1:resume")
    assert first.returncode == -9 and "@@stopped-after-save" in first.stdout
    assert expected_resume(run_dir, "pretrain_64", iters=6) == (1, 5)
    second = run_script(run_dir, replace=ddp)
    assert second.returncode == 0, second.stderr[-3000:]
    assert_resumed(second, 1, 5)
    assert_same_run(ref, tmp_path / "ref", [first, second], run_dir)


def test_own_datamodule_subclass_resumes_a_minimind_file_at_its_position(tmp_path: Path) -> None:
    """Lightning keeps a DataModule's state under its class's name: a MiniMind file's position (converted for
    ``MiniMindDataModule``) reaches a user's subclass too, so the run resumes after step 5, not from the start."""
    need_shared()
    from tests.helpers.runs import MINIMIND

    src = MINIMIND / "original_run" / "checkpoints__pretrain_64_resume.step5.pth"
    subclass = ("data = MiniMindDataModule(", "class MyData(MiniMindDataModule):\n    pass\n\n\ndata = MyData(")
    run = run_cli(tmp_path, [str(TINY_JSONL), str(TOKENIZER), str(src)], env=cli_env(),
                  command=write_script(tmp_path, replace=(subclass, ('ckpt_path="last"', "ckpt_path=sys.argv[3]"))))
    assert run.returncode == 0, run.stderr[-3000:]
    assert_resumed(run, 1, 6)
    assert sorted(run.steps) == [(1, step) for step in range(6, 13)]
    # MiniMind's file is mid-window (step 5, 2 batches per step): said in a plain line, in a script as in the CLI
    assert any(line.startswith("the checkpoint was saved inside an accumulation window (step 5")
               for line in run.stderr.splitlines()), run.stderr[-3000:]
    assert "UserWarning" not in run.stderr, run.stderr[-3000:]
