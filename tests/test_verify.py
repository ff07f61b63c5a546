"""``lit_minimind.checkpoint.read.verify_file``: any changed byte of a ``torch.save`` file is caught, no manifest needed.

The exhaustive tests change every byte of small files (a state dict; a Lightning-like checkpoint
with optimizer state, a GradScaler, python values and an empty tensor) and cut them at every
length: record data is covered by the CRC-32s, every other byte (headers, names, torch's
alignment padding, data descriptors, central directory, end records) by the structural checks.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import zipfile
from pathlib import Path

import pytest
import torch

from lit_minimind.checkpoint.read import verify_file
from lit_minimind.errors import CheckpointError, NotACheckpoint, NotATorchZip, UnverifiableCheckpoint
from tests.helpers.runs import MINIMIND, need_shared


def state_dict_obj() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"layer.weight": torch.randn(4, 4, generator=g), "layer.bias": torch.zeros(4, dtype=torch.float16),
            "index": torch.arange(3)}


def lightning_like_obj() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-4)
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    return {"epoch": 0, "global_step": 3, "pytorch-lightning_version": "2.6.0", "state_dict": model.state_dict(),
            "loops": {"fit_loop": {"epoch_progress": {"current": {"ready": 1}}}},
            "callbacks": {"ResumeCallback": {"step": 6, "wandb_id": "abc", "grads": None, "rng": (1, 2.5, "x")}},
            "optimizer_states": [opt.state_dict()], "lr_schedulers": [], "CPUFloat16Mixed": scaler.state_dict(),
            "hparams": {"lr": 5e-4, "name": "名前"}, "empty": torch.empty(0)}


OBJECTS = {"state_dict": state_dict_obj, "lightning_like": lightning_like_obj}


@pytest.fixture(params=list(OBJECTS))
def saved(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    path = tmp_path / f"{request.param}.pth"
    torch.save(OBJECTS[request.param](), path)
    assert 1000 < path.stat().st_size < 8000  # small: every byte is tried below
    return path


def raises(path: Path, **kwargs) -> CheckpointError:
    with pytest.raises(CheckpointError) as info:
        verify_file(path, **kwargs)
    assert str(path) in str(info.value)  # the message names the file
    return info.value


def test_unmodified_files_pass(saved: Path) -> None:
    verify_file(saved)
    verify_file(str(saved))
    for chunk_size in (1, 7, 64, 1000):  # buffer boundaries inside headers, names and data
        verify_file(saved, chunk_size=chunk_size)
    torch.load(saved, weights_only=True)


def test_every_changed_byte_is_detected(saved: Path) -> None:
    data = saved.read_bytes()
    missed, kinds = [], set()
    fd = os.open(saved, os.O_RDWR)
    try:
        for offset in range(len(data)):
            for mask in (0xFF, 1 << (offset % 8)):  # every byte inverted, and one bit of each
                os.pwrite(fd, bytes([data[offset] ^ mask]), offset)
                try:
                    verify_file(saved)
                except CheckpointError as err:
                    assert str(saved) in str(err)
                    kinds.add(type(err))
                else:
                    missed.append((offset, mask))
                os.pwrite(fd, data[offset:offset + 1], offset)
    finally:
        os.close(fd)
    assert not missed, f"undetected changes (offset, xor mask): {missed[:20]}"
    assert saved.read_bytes() == data
    verify_file(saved)


def test_changed_bytes_detected_across_buffer_boundaries(saved: Path) -> None:
    data = saved.read_bytes()
    for offset in range(0, len(data), 5):
        changed = saved.with_name("changed.pth")
        changed.write_bytes(data[:offset] + bytes([data[offset] ^ 0x10]) + data[offset + 1:])
        raises(changed, chunk_size=7)


def flips_missed(path: Path, offsets: range) -> list[int]:
    data, missed = path.read_bytes(), []
    fd = os.open(path, os.O_RDWR)
    try:
        for offset in offsets:
            os.pwrite(fd, bytes([data[offset] ^ 0xFF]), offset)
            try:
                verify_file(path)
            except CheckpointError:
                pass
            else:
                missed.append(offset)
            os.pwrite(fd, data[offset:offset + 1], offset)
    finally:
        os.close(fd)
    return missed


@pytest.mark.parametrize("alignment", [1, 8, 4096])
def test_other_storage_alignments(tmp_path: Path, alignment: int) -> None:
    from torch.utils.serialization import config

    path = tmp_path / "aligned.pth"
    before = config.save.storage_alignment
    config.save.storage_alignment = alignment  # recorded in the file's .storage_alignment record
    try:
        torch.save(state_dict_obj(), path)
    finally:
        config.save.storage_alignment = before
    verify_file(path)
    size = path.stat().st_size
    assert not flips_missed(path, range(0, size, 1 if size < 8000 else 7))


def test_every_truncation_is_detected(saved: Path) -> None:
    size = saved.stat().st_size
    for length in range(size - 1, -1, -1):  # each cut shortens the previous one
        os.truncate(saved, length)
        err = raises(saved)
        assert ("is empty" if length == 0 else "truncated or corrupted") in str(err)


@pytest.mark.parametrize("where", ["appended", "prepended"])
def test_extra_bytes_are_detected(saved: Path, where: str) -> None:
    data = saved.read_bytes()
    extras = [b"\0", b"garbage", b"\n" * 4096, data[-22:],  # a second end-of-central-directory record
              data[-98:],  # the zip64 end record, its locator and the end record again
              data]  # the whole file twice
    for extra in extras:
        saved.write_bytes(data + extra if where == "appended" else extra + data)
        raises(saved)


def test_appended_bytes_are_named(saved: Path) -> None:
    saved.write_bytes(saved.read_bytes() + b"x" * 10)
    assert "10 bytes follow" in str(raises(saved))


def test_corrupted_record_is_named(tmp_path: Path) -> None:
    path = tmp_path / "w.pth"
    torch.save(state_dict_obj(), path)
    info = zipfile.ZipFile(path).getinfo("w/data/0")
    data = bytearray(path.read_bytes())
    data[info.header_offset + 64 + 3] ^= 1  # headers of torch's records end on a 64-byte boundary
    path.write_bytes(bytes(data))
    err = str(raises(path))
    assert "'w/data/0'" in err and "CRC-32" in err


def test_not_a_checkpoint(tmp_path: Path) -> None:
    cases = {
        "empty.pth": (b"", CheckpointError, "is empty"),
        "config.json": (json.dumps({"model": {"hidden_size": 64}}).encode(), NotACheckpoint, "not a checkpoint: JSON"),
        "README.md": (b"# lit-minimind\n\nMiniMind's pretraining on Lightning.\n", NotACheckpoint,
                      "not a checkpoint: text"),
        "random.bin": (b"\x17" + torch.randint(0, 256, (3000,), generator=torch.Generator().manual_seed(1),
                                               dtype=torch.uint8).numpy().tobytes(), NotACheckpoint,
                       "not a checkpoint: unrecognised binary"),
    }
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("notes.txt", "hello")
    cases["other.zip"] = (buf.getvalue(), NotACheckpoint, "did not write")
    for name, (content, kind, message) in cases.items():
        (tmp_path / name).write_bytes(content)
        err = raises(tmp_path / name)
        assert isinstance(err, kind) and message in str(err), (name, err)
    assert "no such checkpoint file" in str(raises(tmp_path / "missing.pth"))
    assert "is a directory" in str(raises(tmp_path))


def test_pickles_are_not_torch_zips(tmp_path: Path) -> None:
    legacy = tmp_path / "legacy.pth"
    torch.save(state_dict_obj(), legacy, _use_new_zipfile_serialization=False)
    err = raises(legacy)
    assert isinstance(err, NotATorchZip) and "not a torch zip checkpoint: torch's legacy" in str(err)
    plain = tmp_path / "plain.pkl"
    plain.write_bytes(pickle.dumps({"step": 3}))
    err = raises(plain)
    assert isinstance(err, NotATorchZip) and "not a torch zip checkpoint: a plain pickle" in str(err)


def test_saved_without_crcs_is_unverifiable(tmp_path: Path) -> None:
    from torch.serialization import get_crc32_options, set_crc32_options

    path = tmp_path / "nocrc.pth"
    before = get_crc32_options()
    set_crc32_options(False)
    try:
        torch.save(state_dict_obj(), path)
    finally:
        set_crc32_options(before)
    err = raises(path)
    assert type(err) is UnverifiableCheckpoint and "without CRC-32s" in str(err)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a changed byte in such a file is still caught where the layout shows it
    path.write_bytes(bytes(data))
    raises(path)


@pytest.mark.parametrize("name", ["checkpoints__pretrain_64_resume.step5.pth", "out__pretrain_64.pth"])
def test_original_minimind_files(tmp_path: Path, name: str) -> None:
    need_shared()
    path = tmp_path / name
    shutil.copyfile(MINIMIND / "original_run" / name, path)  # never modify ../shared
    verify_file(path)
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(b ^ 0xFF for b in data[middle:middle + 64])
    path.write_bytes(bytes(data))
    err = str(raises(path))
    assert "truncated or corrupted checkpoint" in err and "CRC-32" in err
