"""The library API of lesson 15: paths, SkipBatchSampler, save/load of the resume checkpoint."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from lit_minimind import SkipBatchSampler, checkpoint_paths, load_resume_checkpoint, save_resume_checkpoint
from lit_minimind.checkpoint.names import manifest_path
from lit_minimind.checkpoint.read import read_checkpoint
from lit_minimind.data.sampler import EpochShardSampler, ResumableBatchSampler, epoch_permutation
from lit_minimind.errors import CheckpointError
from lit_minimind.model import MiniMindConfig, MiniMindForCausalLM


def test_checkpoint_paths_follow_minimind_naming() -> None:
    assert checkpoint_paths("checkpoints", "pretrain", 768, False) == (
        Path("checkpoints/pretrain_768.pth"), Path("checkpoints/pretrain_768_resume.pth"))
    assert checkpoint_paths("checkpoints", "pretrain", 768, True) == (
        Path("checkpoints/pretrain_768_moe.pth"), Path("checkpoints/pretrain_768_moe_resume.pth"))


def test_skip_batch_sampler_matches_lesson_15() -> None:
    sampler = SkipBatchSampler(range(10), 3, 2)
    assert list(sampler) == [[6, 7, 8], [9]]
    assert len(sampler) == 2
    assert list(SkipBatchSampler(range(10), 3, 0)) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert list(SkipBatchSampler(range(10), 3, 4)) == [] and len(SkipBatchSampler(range(10), 3, 5)) == 0


def test_epoch_permutation_is_minimind_global_seeded_randperm() -> None:
    for epoch in range(3):
        torch.manual_seed(42 + epoch)  # MiniMind: setup_seed(42 + epoch); torch.randperm(len(ds))
        expected = torch.randperm(48).tolist()
        state = torch.get_rng_state()
        assert epoch_permutation(48, epoch) == expected
        assert torch.equal(state, torch.get_rng_state()), "global RNG was disturbed"


def test_resumable_batch_sampler_keeps_epoch_length_and_skips_once() -> None:
    sampler = EpochShardSampler(10)
    batches = ResumableBatchSampler(sampler, 3)
    full = list(batches)
    batches.resume_at(0, 2)
    assert len(batches) == 4
    assert list(batches) == full[2:]
    assert list(batches) == full  # one-shot
    batches.resume_at(1, 1)
    assert list(batches) == full  # armed for epoch 1, we are in epoch 0
    sampler.set_epoch(1)
    epoch1 = epoch_permutation(10, 1)
    assert list(batches) == [epoch1[3:6], epoch1[6:9], epoch1[9:]]


def test_world_size_change_covers_exactly_the_trained_samples() -> None:
    n, batch, step = 103, 4, 5
    trained_on_two = set()
    for rank in range(2):
        shard = list(EpochShardSampler(n, rank, 2))
        trained_on_two.update(shard[: step * batch])
    one = list(EpochShardSampler(n, 0, 1))
    assert set(one[: (step * 2) * batch]) == trained_on_two  # step 5 on 2 ranks == step 10 on 1


def _tiny() -> tuple[MiniMindForCausalLM, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = MiniMindForCausalLM(MiniMindConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                               num_key_value_heads=2, vocab_size=64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 64, (2, 8))
    model(ids, labels=ids).loss.backward()
    opt.step()
    return model, opt


def test_save_and_load_resume_checkpoint_round_trip(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model, opt = _tiny()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    weights, resume = save_resume_checkpoint(model, opt, save_dir=tmp_path, weight="pretrain", hidden_size=32,
                                             use_moe=False, epoch=1, step=20, scaler=scaler, extra_state={"note": "x"})
    assert weights == tmp_path / "pretrain_32.pth" and resume == tmp_path / "pretrain_32_resume.pth"
    assert manifest_path(resume).exists() and not list(tmp_path.glob("*.tmp"))
    exported = torch.load(weights, weights_only=True)
    assert all(v.dtype == torch.float16 for v in exported.values())
    assert "lm_head.weight" in exported and "model.embed_tokens.weight" in exported

    data = load_resume_checkpoint(tmp_path, "pretrain", 32, world_size=1)
    assert data is not None
    assert (data["epoch"], data["step"], data["world_size"], data["wandb_id"], data["note"]) == (1, 20, 1, None, "x")
    assert data["scaler"]["scale"] == 1024.0
    fresh, fresh_opt = _tiny()
    fresh.load_state_dict(data["model"])
    fresh_opt.load_state_dict(data["optimizer"])
    assert torch.equal(fresh.lm_head.weight, model.lm_head.weight.half().float())

    with caplog.at_level(logging.WARNING):
        data = load_resume_checkpoint(tmp_path, "pretrain", 32, world_size=4)  # saved on 1
    assert data["step"] == 5 and "world size changed (1→4): step 20 → 5" in caplog.text
    assert load_resume_checkpoint(tmp_path, "pretrain", 32, use_moe=True) is None


def test_interrupted_save_keeps_previous_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk fills up while the resume file is being written (the weights file is written already):
    the previous resume file is intact, no tmp file is left."""
    from lit_minimind.checkpoint import atomic
    from tests.helpers import faults
    from tests.helpers.faulty_storage import FaultyFileOps

    model, opt = _tiny()
    save_resume_checkpoint(model, opt, save_dir=tmp_path, weight="w", hidden_size=32, use_moe=False, epoch=0, step=1)
    before = (tmp_path / "w_32_resume.pth").read_bytes()
    monkeypatch.setattr(faults, "_counts", {})
    monkeypatch.setenv("LIT_MINIMIND_TEST_FAIL", "write:resume:1:ENOSPC")  # its first data write fails
    monkeypatch.setattr(atomic, "FileOps", FaultyFileOps)  # the default file operations, for this test only
    with pytest.raises(OSError, match="No space left"):
        save_resume_checkpoint(model, opt, save_dir=tmp_path, weight="w", hidden_size=32, use_moe=False, epoch=0, step=2)
    written = torch.load(tmp_path / "w_32.pth", weights_only=True)  # the step-2 weights went in before it
    assert written.keys() == {k for k in model.state_dict()}
    assert (tmp_path / "w_32_resume.pth").read_bytes() == before
    assert load_resume_checkpoint(tmp_path, "w", 32, world_size=1)["step"] == 1
    assert not list(tmp_path.glob("*.tmp"))


def test_read_checkpoint_explains_bad_files(tmp_path: Path) -> None:
    model, opt = _tiny()
    _, resume = save_resume_checkpoint(model, opt, save_dir=tmp_path, weight="w", hidden_size=32, use_moe=False,
                                       epoch=0, step=1)
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        read_checkpoint(tmp_path / "missing.pth")
    empty = tmp_path / "empty.pth"
    empty.write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"empty.pth: is empty"):
        read_checkpoint(empty)
    data = resume.read_bytes()
    resume.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        read_checkpoint(resume)
    truncated_no_manifest = tmp_path / "t.pth"
    truncated_no_manifest.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="t.pth: truncated or corrupted"):
        read_checkpoint(truncated_no_manifest)
    foreign = tmp_path / "foreign.pth"
    foreign.write_text("hello, I am not a checkpoint")
    with pytest.raises(CheckpointError, match="foreign.pth"):
        read_checkpoint(foreign)


def test_manifest_accepts_the_file_it_replaces_until_the_rename(tmp_path: Path) -> None:
    """A kill between writing the manifest and renaming the data leaves the old file: still valid."""
    from lit_minimind.checkpoint.atomic import atomic_save

    path = tmp_path / "x.pth"
    atomic_save({"v": torch.zeros(10)}, path)
    old_bytes = path.read_bytes()
    atomic_save({"v": torch.ones(1000)}, path)
    assert read_checkpoint(path)["v"].shape == (1000,)
    path.write_bytes(old_bytes)  # the state a kill before os.replace leaves: new manifest, old file
    assert read_checkpoint(path)["v"].shape == (10,)
    path.write_bytes(old_bytes[:-10])
    with pytest.raises(CheckpointError, match="size"):
        read_checkpoint(path)


def test_resume_link_is_a_copy_where_a_hard_link_cannot_be(tmp_path: Path) -> None:
    """A hard link across filesystems fails with EXDEV (a real one: /dev/shm is a tmpfs): the file is
    copied instead, with the source's manifest, and reads back verified."""
    import errno
    import os
    import tempfile

    from lit_minimind.checkpoint.atomic import atomic_link, atomic_save

    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("no second filesystem to link across")
    with tempfile.TemporaryDirectory(dir=shm) as other:
        source = Path(other) / "pretrain_32_e0_s1_g1.ckpt"
        atomic_save({"step": 1, "w": torch.arange(4.0)}, source)
        with pytest.raises(OSError) as cross:  # what the fallback is for
            os.link(source, tmp_path / "probe")
        assert cross.value.errno == errno.EXDEV
        target = tmp_path / "pretrain_32_resume.pth"
        atomic_link(source, target)
        assert not os.path.samefile(source, target) and target.read_bytes() == source.read_bytes()
        assert read_checkpoint(target)["step"] == 1
        assert not list(tmp_path.glob("*.tmp"))


def test_resume_link_is_a_hard_link_where_it_can_be(tmp_path: Path) -> None:
    import os

    from lit_minimind.checkpoint.atomic import atomic_link, atomic_save

    source = tmp_path / "pretrain_32_e0_s1_g1.ckpt"
    atomic_save({"step": 1}, source)
    atomic_link(source, tmp_path / "pretrain_32_resume.pth")
    assert os.path.samefile(source, tmp_path / "pretrain_32_resume.pth")


def test_resume_from_other_library_versions_warns(capsys: pytest.CaptureFixture[str]) -> None:
    """A checkpoint written with another torch or Lightning: a plain line that resume may not be bit-exact;
    with the same versions: none."""
    import warnings

    from lit_minimind.callbacks.resume import ResumeCallback
    from lit_minimind.resume.states import library_versions

    here = library_versions()
    for lib in ("torch", "lightning"):
        message = f"checkpoint was written with {lib} 0.0.1, this run uses {here[lib]}: resume may not be bit-exact"
        ResumeCallback().load_state_dict({"versions": {**here, lib: "0.0.1"}})
        assert capsys.readouterr().err == message + "\n"  # the line itself: no file, line number or UserWarning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ResumeCallback().load_state_dict({"versions": dict(here)})
    assert capsys.readouterr().err == ""
