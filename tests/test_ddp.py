"""DDP on CPU (gloo, 2 processes): smoke run, kill + exact resume on 2, and resume on 1 (world-size correction)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.runs import TINY_JSONL, assert_resumed, cli_env, need_shared, run_cli, tiny_args


def load_out(run_dir: Path) -> dict:
    return torch.load(run_dir / "out" / "pretrain_64.pth", weights_only=True)


@pytest.mark.slow  # five 2-process runs: under a minute (make test-slow)
@pytest.mark.compat  # and on the oldest Lightning (make test-compat)
def test_ddp_killed_and_resumed_on_two_and_on_one(tmp_path: Path) -> None:
    need_shared()
    ddp = tiny_args(epochs=2, accumulate=2, save_interval=4, devices=2)
    single_args = tiny_args(epochs=2, accumulate=2, save_interval=4, devices=1)
    ref_dir, killed_dir = tmp_path / "ref", tmp_path / "killed"
    ref_dir.mkdir(), killed_dir.mkdir()

    ref = run_cli(ref_dir, ddp)
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert len(ref.steps) == 12  # 2 epochs x 6 batches per rank
    # each rank's own RNG stream, seeded 42 + rank as MiniMind's setup_seed (not 42 on every rank)
    ranks = torch.load(ref_dir / "checkpoints" / "pretrain_64_resume.pth", weights_only=True)["lit_minimind"]["ranks"]
    seeds = []
    for state in ranks:
        generator = torch.Generator()
        generator.set_state(state["rng"]["torch"])
        seeds.append(generator.initial_seed())
    assert seeds == [42, 43]

    # killed (whole process group) right after the 9th file commit: the export of epoch 2's step-4 save
    killed = run_cli(killed_dir, ddp + ["--ckpt_path", "last"], env=cli_env(LIT_MINIMIND_TEST_STOP_AFTER_SAVE="3:export"))
    assert killed.returncode == -9 and "@@stopped-after-save" in killed.stdout
    resumed = run_cli(killed_dir, ddp + ["--ckpt_path", "last"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_resumed(resumed, 2, 5)
    assert resumed.steps == {k: ref.steps[k] for k in [(2, 5), (2, 6)]}, "the resumed run trains epoch 2's last two"
    ref_out, got_out = load_out(ref_dir), load_out(killed_dir)
    assert got_out.keys() == ref_out.keys() and ref_out
    assert all(torch.equal(ref_out[k], got_out[k]) for k in ref_out)

    # the same 2-process checkpoint (epoch 1, step 4 of 6) resumed on a single process
    one_dir = tmp_path / "one"
    one_dir.mkdir()
    # SIGKILLed inside the second checkpoint's commit: the step-4 save is complete, the epoch-end one is not
    half = run_cli(one_dir, ddp + ["--ckpt_path", "last"], env=cli_env(LIT_MINIMIND_TEST_STOP_IN_SAVE="2:checkpoint"))
    assert half.returncode == -9
    ckpts = sorted((one_dir / "checkpoints").glob("*.ckpt"))
    assert ckpts, "no checkpoint was written before the kill"
    single = run_cli(one_dir, single_args + ["--ckpt_path", "last"])
    assert single.returncode == 0, single.stderr[-3000:]
    assert "world size changed (2→1): step 4 → 8" in single.stderr
    assert_resumed(single, 1, 9)
    assert sorted(single.steps) == [(1, s) for s in range(9, 13)] + [(2, s) for s in range(1, 13)]
    resume = torch.load(one_dir / "checkpoints" / "pretrain_64_resume.pth", weights_only=True)
    assert resume["world_size"] == 1 and resume["epoch"] == 1 and resume["step"] == 12


@pytest.mark.slow
def test_epoch_end_checkpoint_resumes_on_another_world_size_at_the_next_epoch(tmp_path: Path) -> None:
    """41 samples: 6 batches per rank on 2 ranks but 11 on 1: the finished epoch stays finished."""
    need_shared()
    data = tmp_path / "odd.jsonl"
    data.write_text("".join(TINY_JSONL.read_text().splitlines(True)[:41]))
    two = run_cli(tmp_path, tiny_args(epochs=1, devices=2) + ["--data.data_path", str(data)])
    assert two.returncode == 0, two.stderr[-3000:]
    one = run_cli(tmp_path, tiny_args(epochs=2) + ["--data.data_path", str(data), "--ckpt_path", "last"])
    assert one.returncode == 0, one.stderr[-3000:]
    assert "world size changed (2→1)" in one.stderr
    assert_resumed(one, 2, 1)
    assert sorted(one.steps) == [(2, s) for s in range(1, 12)]


def test_each_rank_validates_its_share_of_the_validation_split() -> None:
    need_shared()
    from types import SimpleNamespace

    from lit_minimind.data.datamodule import MiniMindDataModule
    from tests.helpers.runs import TOKENIZER

    dm = MiniMindDataModule(data_path=str(TINY_JSONL), tokenizer_path=str(TOKENIZER), max_seq_len=64, batch_size=2,
                            val_fraction=0.25)
    dm.setup("fit")
    seen = []
    for rank in range(2):
        dm.trainer = SimpleNamespace(world_size=2, global_rank=rank, current_epoch=0)
        seen.append(list(dm.val_dataloader().sampler))
    assert len(dm.val_dataset) == 12 and [len(s) for s in seen] == [6, 6] and sorted(seen[0] + seen[1]) == list(range(12))


@pytest.mark.slow
def test_one_process_checkpoint_resumes_on_two(tmp_path: Path) -> None:
    """Saved by 1 process at step 6 of 12 (due at 5, taken at its optimizer step), resumed on 2 (6 batches
    per rank): MiniMind's rule ``step * 1 // 2`` = 3 per rank, which is inside a 2-batch window: said in
    one line (no partial gradient is saved), and both epochs finish."""
    need_shared()
    one = tiny_args(epochs=2, accumulate=2, save_interval=5)
    killed = run_cli(tmp_path, one, env=cli_env(LIT_MINIMIND_TEST_STOP_AFTER_SAVE="1:export"))
    assert killed.returncode == -9 and "@@stopped-after-save" in killed.stdout
    two = run_cli(tmp_path, tiny_args(epochs=2, accumulate=2, save_interval=5, devices=2) + ["--ckpt_path", "last"])
    assert two.returncode == 0, two.stderr[-3000:]
    assert "world size changed (1→2): step 6 → 3" in two.stderr
    assert "holds no partial gradients" in two.stderr
    assert_resumed(two, 1, 4)
    assert sorted(two.steps) == [(1, s) for s in range(4, 7)] + [(2, s) for s in range(1, 7)]
    resume = torch.load(tmp_path / "checkpoints" / "pretrain_64_resume.pth", weights_only=True)
    assert (resume["world_size"], resume["epoch"], resume["step"]) == (2, 1, 6)
