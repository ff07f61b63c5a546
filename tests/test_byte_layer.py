"""The byte layer's rules, each in one place: a checkpoint's name, a file's fingerprint, retention."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lit_minimind.checkpoint.atomic import Fingerprint, atomic_receive, atomic_save, read_manifest, remove_file
from lit_minimind.checkpoint.names import CheckpointName, expired, manifest_path
from lit_minimind.errors import CheckpointError


def test_a_checkpoint_name_formats_and_parses_back() -> None:
    name = CheckpointName("pretrain_64_moe", 1, 20, 45, "0a1b2c3d")
    assert str(name) == "pretrain_64_moe_e1_s20_g45_0a1b2c3d.ckpt"
    assert CheckpointName.parse(str(name)) == name
    assert CheckpointName.parse(f"/some/dir/{name}") == name
    for other in ("pretrain_64_best.ckpt", "pretrain_64_resume.pth", "pretrain_64_e1_s2_g3_0a1b.ckpt.manifest.json",
                  "pretrain_64_e1_s2_gX_0a1b.ckpt"):
        assert CheckpointName.parse(other) is None, other
    assert CheckpointName.of("s", {"epoch": 0, "step": "7", "global_step": 7, "run_id": "ab"}) == CheckpointName("s", 0, 7, 7, "ab")


def test_find_takes_only_this_stems_checkpoints(tmp_path: Path) -> None:
    names = [CheckpointName("pretrain_64", 0, s, s, "ab") for s in (1, 2)]
    for name in [*map(str, names), "pretrain_64_best.ckpt", "pretrain_640_e0_s1_g1_ab.ckpt", "pretrain_64_resume.pth"]:
        (tmp_path / name).write_bytes(b"x")
    assert sorted(p.name for p in CheckpointName.find(tmp_path, "pretrain_64")) == sorted(map(str, names))


def test_retention_keeps_a_runs_newest_and_never_touches_another_run() -> None:
    saves = [("a1", "a", 1), ("b1", "b", 2), ("a3", "a", 3), ("a2", "a", 2), ("b9", "b", 9)]
    assert expired(saves, "a", 2) == ["a1"]
    assert expired(saves, "a", 1) == ["a2", "a1"]
    assert expired(saves, "b", 5) == [] and expired(saves, "c", 1) == []


def test_a_local_directory_and_a_bucket_are_one_storage_with_one_retention(tmp_path: Path) -> None:
    """``LocalDir`` and ``RemoteDir`` (here on ``file://``: the same fsspec code as ``s3://``) answer the same
    ``list`` / ``commit`` / ``read`` / ``remove``, and ``retain`` / ``retain_runs`` remove the same files from both."""
    from lit_minimind.checkpoint.atomic import LocalDir, retain, retain_runs
    from lit_minimind.checkpoint.remote import RemoteDir

    source = tmp_path / "source"
    local, remote = LocalDir(tmp_path / "local"), RemoteDir(f"file://{tmp_path / 'remote'}")
    saves = [("a", 1), ("b", 2), ("a", 3), ("c", 4), ("a", 5), ("b", 6)]  # (run, step), oldest first
    for run, step in saves:
        name = str(CheckpointName("pretrain_64", 0, step, step, run * 8))
        atomic_save({"step": step}, source / name, {"run_id": run * 8, "saved_at": step})
        for storage in (local, remote):
            storage.commit(name, source / name, read_manifest(source / name))
    pattern = CheckpointName.pattern("pretrain_64")
    listed = [[name for name, _ in storage.list(pattern)] for storage in (local, remote)]
    assert listed[0] == listed[1] and [CheckpointName.parse(n).step for n in listed[0]] == [6, 5, 4, 3, 2, 1]
    assert b"".join(remote.read(listed[0][0])) == b"".join(local.read(listed[0][0])) == (source / listed[0][0]).read_bytes()
    removed = [retain(storage, pattern, "a" * 8, 1) for storage in (local, remote)]
    assert removed[0] == removed[1] and [CheckpointName.parse(n).step for n in removed[0]] == [3, 1]
    by_run = [retain_runs(storage, pattern, "c" * 8, 2) for storage in (local, remote)]  # c's own and the newest other
    assert by_run[0] == by_run[1] and set(by_run[0]) == {"a" * 8}
    left = [[CheckpointName.parse(n).step for n, _ in storage.list(pattern)] for storage in (local, remote)]
    assert left[0] == left[1] == [6, 4, 2]


def test_a_manifest_records_the_files_fingerprint(tmp_path: Path) -> None:
    path = tmp_path / "x.pth"
    manifest = atomic_save({"w": torch.arange(10)}, path, {"epoch": 0})
    assert Fingerprint.recorded(manifest) == Fingerprint.of_file(path) == Fingerprint.recorded(read_manifest(path))
    assert Fingerprint.recorded(manifest).size == path.stat().st_size
    first = Fingerprint.recorded(manifest)
    second = atomic_save({"w": torch.arange(11)}, path)
    assert Fingerprint.recorded(second, "replaces") == first != Fingerprint.recorded(second)
    assert Fingerprint.recorded({"size": 3}) is None and Fingerprint.recorded({}, "replaces") is None


def test_a_download_that_does_not_match_its_manifest_leaves_nothing(tmp_path: Path) -> None:
    good = atomic_save({"w": torch.ones(4)}, tmp_path / "a.pth")
    data = (tmp_path / "a.pth").read_bytes()
    target = tmp_path / "in" / "a.pth"
    with pytest.raises(CheckpointError, match="received .* bytes"):
        atomic_receive([data[:10], b"", bytes([data[10] ^ 1]), data[11:]], target, good)
    assert not target.exists() and not list(target.parent.iterdir())
    atomic_receive([data[:10], b"", data[10:]], target, good)
    assert target.read_bytes() == data and Fingerprint.recorded(read_manifest(target)) == Fingerprint.recorded(good)


def test_removal_takes_the_manifest_and_the_data(tmp_path: Path) -> None:
    path = tmp_path / "x.ckpt"
    atomic_save({"w": torch.ones(1)}, path)
    remove_file(path)
    assert not path.exists() and not manifest_path(path).exists()
    remove_file(path)  # already gone: nothing to do


def test_a_test_fault_names_what_it_commits_not_an_ordinal() -> None:
    """tests/helpers/faults.py: a fault addresses a commit by its kind (one more file per save shifts no test)."""
    from tests.helpers.faults import is_the_commit, kind_of

    assert [kind_of(n) for n in ("pretrain_64_e1_s5_g3_ab.ckpt", "pretrain_64_best.ckpt", "pretrain_64_resume.pth",
                                 "pretrain_64.pth", "index.json")] == ["checkpoint", "best", "resume", "export", None]
    assert kind_of("hf", directory=True) == "directory"
    assert [is_the_commit("t", "2:resume", k) for k in ("checkpoint", "resume", "export", "resume", "resume")] == [
        False, False, False, True, False]
    with pytest.raises(ValueError, match="N:KIND"):
        is_the_commit("t", "3", "checkpoint")
