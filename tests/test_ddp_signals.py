"""SIGTERM to DDP rank 1 alone, in each start-up phase of a resume (2 processes, gloo): no hang, every
rank exits 0, one line; the run resumed afterwards ends exactly as the uninterrupted one. Lightning's
own SIGTERM handler (active from the end of restore until training starts) broadcasts inside the
handler; ``python -m lit_minimind.fit`` keeps SIGTERM away from it (``STOP.hold_sigterm``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.runs import need_shared, run_cli, tiny_args

# make test-slow: during restore and as training starts; make test-matrix: the phases before restore and between
# (they behave like restore itself, as in test_startup_signals)
PHASES = [pytest.param(p, marks=pytest.mark.matrix) if p in ("setup", "on_fit_start", "train_dataloader") else p
          for p in ("setup", "on_load_checkpoint", "on_fit_start", "train_dataloader", "on_train_batch_start")]
HANG_S = 240


def config(*extra: str) -> list[str]:
    return tiny_args(*extra, epochs=2, accumulate=2, save_interval=4, devices=2)  # 6 batches per rank and epoch


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    need_shared()
    ref_dir = tmp_path_factory.mktemp("ref")
    ref = run_cli(ref_dir, config())
    assert ref.returncode == 0, ref.stderr[-3000:]
    return ref_dir, ref.steps


@pytest.mark.slow
@pytest.mark.parametrize("phase", PHASES)
def test_sigterm_to_rank_1_alone_during_start_up(tmp_path: Path, phase: str, reference: tuple[Path, dict]) -> None:
    ref_dir, ref_steps = reference
    first = run_cli(tmp_path, config(), kill_after_lines=9)  # epoch 2 step 3: epoch 1's end is committed
    assert first.returncode == -9

    signal_rank_1 = ["--trainer.callbacks+=tests.helpers.signal_at.SignalAt", f"--trainer.callbacks.phase={phase}",
                     "--trainer.callbacks.signame=SIGTERM", "--trainer.callbacks.rank=1"]
    stopped = run_cli(tmp_path, config("--ckpt_path", "last", *signal_rank_1), limit=HANG_S)
    assert not stopped.timed_out, f"a rank still ran after {HANG_S} s (a hang)"
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert "Traceback" not in stopped.stderr
    assert stopped.stdout.count("SIGTERM received") == 1  # rank 1's; rank 0 got none
    assert len([line for line in stopped.stderr.splitlines() if "stopped by" in line]) == 1, stopped.stderr[-2000:]

    done = run_cli(tmp_path, config("--ckpt_path", "last"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert max(done.steps) == max(ref_steps)
    for run in (first, stopped, done):
        for key, values in run.steps.items():
            assert values == ref_steps[key], key
    ref_w = torch.load(ref_dir / "out" / "pretrain_64.pth", weights_only=True)
    got_w = torch.load(tmp_path / "out" / "pretrain_64.pth", weights_only=True)
    assert all(torch.equal(ref_w[k], got_w[k]) for k in ref_w)
