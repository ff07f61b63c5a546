"""DDP on CPU (gloo, 2 processes): smoke run, kill + exact resume on 2, and resume on 1 (world-size correction)."""

from __future__ import annotations

from pathlib import Path

import torch
from conftest import TINY_JSONL, cli_env, need_shared, run_cli, tiny_args


def load_out(run_dir: Path) -> dict:
    return torch.load(run_dir / "out" / "pretrain_64.pth", weights_only=True)


def test_ddp_killed_and_resumed_on_two_and_on_one(tmp_path: Path) -> None:
    need_shared()
    ddp = tiny_args(epochs=2, accumulate=2, save_interval=5, devices=2)
    single_args = tiny_args(epochs=2, accumulate=2, save_interval=5, devices=1)
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

    # killed (whole process group) during epoch 2: resumes from epoch 1's end or epoch 2's step 5
    killed = run_cli(killed_dir, ddp + ["--ckpt_path", "last"], kill_after_lines=9)
    assert killed.returncode == -9
    resumed = run_cli(killed_dir, ddp + ["--ckpt_path", "last"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for key, values in resumed.steps.items():
        assert values == ref.steps[key], f"step {key} differs after DDP resume"
    assert all(torch.equal(a, b) for a, b in zip(load_out(ref_dir).values(), load_out(killed_dir).values()))

    # the same 2-process checkpoint (epoch 1, step 5 of 6) resumed on a single process
    one_dir = tmp_path / "one"
    one_dir.mkdir()
    # SIGKILLed inside the 4th file write: the step-5 save (3 files) is complete, the epoch-end one is not
    half = run_cli(one_dir, ddp + ["--ckpt_path", "last"], env=cli_env(LIT_MINIMIND_TEST_STOP_IN_SAVE="4"))
    assert half.returncode == -9
    ckpts = sorted((one_dir / "checkpoints").glob("*.ckpt"))
    assert ckpts, "no checkpoint was written before the kill"
    single = run_cli(one_dir, single_args + ["--ckpt_path", "last"])
    assert single.returncode == 0, single.stderr[-3000:]
    assert "world size changed (2→1): step 5 → 10" in single.stderr
    assert "resuming epoch 1 at step 11/12: skipping 10 trained batches" in single.stderr
    assert sorted(single.steps) == [(1, 11), (1, 12)] + [(2, s) for s in range(1, 13)]
    resume = torch.load(one_dir / "checkpoints" / "pretrain_64_resume.pth", weights_only=True)
    assert resume["world_size"] == 1 and resume["epoch"] == 1 and resume["step"] == 12


def test_epoch_end_checkpoint_resumes_on_another_world_size_at_the_next_epoch(tmp_path: Path) -> None:
    """41 samples: 6 batches per rank on 2 ranks but 11 on 1: the finished epoch stays finished."""
    need_shared()
    data = tmp_path / "odd.jsonl"
    data.write_text("".join(TINY_JSONL.read_text().splitlines(True)[:41]))
    two = run_cli(tmp_path, tiny_args(epochs=1, devices=2) + ["--data.data_path", str(data)])
    assert two.returncode == 0, two.stderr[-3000:]
    one = run_cli(tmp_path, tiny_args(epochs=2) + ["--data.data_path", str(data), "--ckpt_path", "last"])
    assert one.returncode == 0, one.stderr[-3000:]
    assert "world size changed (2→1)" in one.stderr and "resuming at the start of epoch 2" in one.stderr
    assert sorted(one.steps) == [(2, s) for s in range(1, 12)]


def test_each_rank_validates_its_share_of_the_validation_split() -> None:
    need_shared()
    from types import SimpleNamespace

    from conftest import TOKENIZER

    from lit_minimind.data.datamodule import MiniMindDataModule

    dm = MiniMindDataModule(data_path=str(TINY_JSONL), tokenizer_path=str(TOKENIZER), max_seq_len=64, batch_size=2,
                            val_fraction=0.25)
    dm.setup("fit")
    seen = []
    for rank in range(2):
        dm.trainer = SimpleNamespace(world_size=2, global_rank=rank, current_epoch=0)
        seen.append(list(dm.val_dataloader().sampler))
    assert len(dm.val_dataset) == 12 and [len(s) for s in seen] == [6, 6] and sorted(seen[0] + seen[1]) == list(range(12))
