"""Partial gradients per rank: a save inside an accumulation window under DDP (2 CPU processes) writes one
shard per rank beside the checkpoint, the manifest lists each with its CRC, a damaged shard makes its
checkpoint no candidate, each rank resumes from its own shard exactly, pruning takes the shards along,
and a checkpoint of the previous format (gradients inline) still resumes exactly."""

from __future__ import annotations

import shutil
import zlib
from pathlib import Path

import pytest
import torch
from conftest import assert_resumed, cli_env, need_shared, run_cli, tiny_args

from lit_minimind.callbacks.files import CheckpointFiles
from lit_minimind.checkpoint.atomic import read_manifest
from lit_minimind.checkpoint.names import manifest_path
from lit_minimind.cli.inspect import summarize

DDP = tiny_args(epochs=1, accumulate=2, save_interval=1, devices=2) + ["--resume.keep_last", "100"]


def only(ckpts: Path, pattern: str) -> Path:
    found = list(ckpts.glob(pattern))
    assert len(found) == 1, (pattern, found)
    return found[0]


def exports_equal(a: Path, b: Path) -> bool:
    x, y = (torch.load(d / "out" / "pretrain_64.pth", weights_only=True) for d in (a, b))
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def copy_until(ckpts: Path, dest: Path, newest: Path) -> None:
    """``dest/checkpoints``: the run's checkpoints (and shards) saved up to ``newest``, as a kill after it leaves them."""
    (dest / "checkpoints").mkdir(parents=True)
    saved_at = read_manifest(newest)["saved_at"]
    for ckpt in ckpts.glob("*_e*_s*_g*.ckpt"):
        manifest = read_manifest(ckpt)
        if manifest["saved_at"] <= saved_at:
            for entry in [{"file": ckpt.name}, *(manifest.get("shards") or [])]:
                for f in (ckpts / entry["file"], manifest_path(ckpts / entry["file"])):
                    shutil.copy2(f, dest / "checkpoints")


@pytest.mark.slow  # four 2-process runs: half a minute
def test_mid_window_ddp_save_writes_one_shard_per_rank_and_resumes_from_it(tmp_path: Path) -> None:
    need_shared()
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    ref = run_cli(ref_dir, DDP)
    assert ref.returncode == 0, ref.stderr[-3000:]
    ckpts = ref_dir / "checkpoints"

    # step 5 of 6, inside the third window: one shard per rank, each listed with its size and CRC-32
    step5 = only(ckpts, "*_e0_s5_*.ckpt")
    shards = read_manifest(step5)["shards"]
    assert [s["rank"] for s in shards] == [0, 1] and [s["file"] for s in shards] == [
        f"{step5.name}.rank0.grads", f"{step5.name}.rank1.grads"]
    for entry in shards:
        data = (ckpts / entry["file"]).read_bytes()
        assert (entry["size"], entry["crc32"]) == (len(data), f"{zlib.crc32(data):08x}")
    saved = torch.load(step5, weights_only=True)
    assert saved["lit_minimind"]["shards"] == shards and "grads" not in saved["lit_minimind"]["ranks"][0]
    own = [torch.load(ckpts / s["file"], weights_only=True) for s in shards]
    assert [g["rank"] for g in own] == [0, 1] and own[0]["grads"].keys() == own[1]["grads"].keys()
    assert any(not torch.equal(own[0]["grads"][k], own[1]["grads"][k]) for k in own[0]["grads"]), \
        "each rank's shard holds its own micro-batch's gradients"
    # saves at window boundaries (steps 2, 4, 6) have none; mid-window ones (1, 3, 5) two each
    assert not read_manifest(only(ckpts, "*_e0_s4_*.ckpt")).get("shards")
    assert len(list(ckpts.glob("*.grads"))) == 6
    assert summarize(step5)["gradient_shards"] == [s["file"] for s in shards]

    # resumed from step 5 on 2 processes: each rank applies its own shard; the run ends as the uninterrupted one
    exact = tmp_path / "exact"
    copy_until(ckpts, exact, step5)
    resumed = run_cli(exact, DDP + ["--ckpt_path", "last"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_resumed(resumed, 1, 6)
    assert resumed.steps == {(1, 6): ref.steps[(1, 6)]} and exports_equal(ref_dir, exact)

    # rank 1's shard corrupted: step 5 is no candidate (one line says why), step 4 is resumed, still exact
    damaged = tmp_path / "damaged"
    copy_until(ckpts, damaged, step5)
    shard1 = damaged / "checkpoints" / shards[1]["file"]
    data = bytearray(shard1.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard1.write_bytes(bytes(data))
    assert "rank 1 partial-gradient shard" in summarize(damaged / "checkpoints" / step5.name)["error"]
    fallback = run_cli(damaged, DDP + ["--ckpt_path", "last"])
    assert fallback.returncode == 0, fallback.stderr[-3000:]
    assert f"skipping checkpoint checkpoints/{step5.name}: its rank 1 partial-gradient shard {shards[1]['file']}: " \
        "checksum (crc32) differs from the one recorded when it was saved (corrupted)" in fallback.stderr
    assert_resumed(fallback, 1, 5)
    assert fallback.steps == {k: ref.steps[k] for k in [(1, 5), (1, 6)]} and exports_equal(ref_dir, damaged)

    # a missing shard: the same, with its own reason
    (exact / "checkpoints" / shards[0]["file"]).unlink()
    assert "is missing" in summarize(exact / "checkpoints" / step5.name)["error"]

    # pruning removes a checkpoint's shards (and their manifests) with it
    pruned = tmp_path / "pruned"
    shutil.copytree(ckpts, pruned)
    CheckpointFiles(pruned, tmp_path / "out", "pretrain", keep_last=1).prune("pretrain_64", read_manifest(step5)["run_id"])
    assert sorted(p.name for p in pruned.glob("*_e*.ckpt")) == [only(ckpts, "*_e0_s6_*.ckpt").name]
    assert not list(pruned.glob("*.grads*"))


def test_checkpoint_with_gradients_inline_still_resumes_exactly(tmp_path: Path) -> None:
    """The previous format (every rank's gradients in the checkpoint file, no shards) loads as before."""
    need_shared()
    one = tiny_args(epochs=1, accumulate=2, save_interval=5) + ["--resume.keep_last", "100"]
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    ref = run_cli(ref_dir, one)
    assert ref.returncode == 0, ref.stderr[-3000:]
    step5 = only(ref_dir / "checkpoints", "*_e0_s5_*.ckpt")
    ckpt = torch.load(step5, weights_only=True)
    state = ckpt["lit_minimind"]
    grads = torch.load(step5.parent / state["shards"][0]["file"], weights_only=True)["grads"]
    ckpt["lit_minimind"] = {"ranks": [{"rng": state["ranks"][0]["rng"], "grads": grads}], "world_size": 1}
    old_dir = tmp_path / "old"
    (old_dir / "checkpoints").mkdir(parents=True)
    torch.save(ckpt, old_dir / "checkpoints" / "old.ckpt")  # as the previous version wrote it (no shard files)
    resumed = run_cli(old_dir, one + ["--ckpt_path", "checkpoints/old.ckpt"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_resumed(resumed, 1, 6)
    assert resumed.steps == {k: v for k, v in ref.steps.items() if k >= (1, 6)} and exports_equal(ref_dir, old_dir)


def test_a_shard_that_cannot_be_written_leaves_its_checkpoint_uncommitted(tmp_path: Path) -> None:
    """The step-5 save (inside a window) cannot write its shard (disk full): the checkpoint is never
    committed, the run stops with one line naming the save and the shard (exit 2), no tmp file left."""
    need_shared()
    failed = run_cli(tmp_path, tiny_args(epochs=1, accumulate=2, save_interval=5),
                     env=cli_env(LIT_MINIMIND_TEST_FAIL="write:.grads:1:ENOSPC"))
    assert failed.returncode == 2, failed.stderr[-2000:]
    errors = [line for line in failed.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "could not save the checkpoint at epoch 1 step 5" in errors[0], failed.stderr[-2000:]
    assert "partial-gradient shard not written" in errors[0] and "No space left" in errors[0]
    ckpts = tmp_path / "checkpoints"
    assert not list(ckpts.glob("*.ckpt")) and not list(ckpts.glob("*.tmp")) and not list(ckpts.glob("*.grads"))


def test_prune_deletes_shards_of_checkpoints_never_committed_but_not_a_save_in_flight(tmp_path: Path) -> None:
    """A kill between the shards and the commit leaves shards no manifest lists: the next prune of that
    run deletes those from before its newest checkpoint; newer ones (a save in flight on another rank),
    another run's and committed checkpoints' shards stay."""
    from lit_minimind.checkpoint.atomic import atomic_save
    from lit_minimind.checkpoint.names import shard_path

    files = CheckpointFiles(tmp_path, tmp_path / "out", "pretrain", keep_last=3)
    ckpt = {k: files.checkpoint("pretrain_64", 0, s, g, "run1") for k, s, g in [("old", 2, 1), ("new", 6, 3)]}
    for path in ckpt.values():
        atomic_save({"x": torch.zeros(1)}, path, meta={"run_id": "run1"})
        atomic_save({"grads": {}}, shard_path(path, 1))
    orphan = files.checkpoint("pretrain_64", 0, 4, 2, "run1")  # killed after its shards
    in_flight = files.checkpoint("pretrain_64", 0, 8, 4, "run1")  # rank 1 wrote its shard, rank 0 not yet committed
    other_run = files.checkpoint("pretrain_64", 0, 4, 2, "run2")
    for path in (orphan, in_flight, other_run):
        for rank in (0, 1):
            atomic_save({"grads": {}}, shard_path(path, rank))
    files.prune("pretrain_64", "run1")
    left = sorted(p.name for p in tmp_path.glob("*.grads"))
    assert left == sorted(shard_path(p, r).name for p, r in [(ckpt["old"], 1), (ckpt["new"], 1), (in_flight, 0),
                                                              (in_flight, 1), (other_run, 0), (other_run, 1)])
    assert not list(tmp_path.glob(f"{orphan.name}*")), "the orphan's shards and their manifests are gone"
