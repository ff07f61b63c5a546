"""``python -m lit_minimind.inspect``: a summary of any checkpoint, JSON for scripts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lit_minimind.checkpoint.names import TRAINING_STATE_FORMAT, TRAINING_STATE_KEY
from tests.helpers.runs import MINIMIND, cli_env, need_shared, run_cli, tiny_args


def inspect(path: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lit_minimind.inspect", str(path), *flags], env=cli_env(),
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def our_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    need_shared()
    run_dir = tmp_path_factory.mktemp("run")
    run = run_cli(run_dir, tiny_args(epochs=1, accumulate=2, save_interval=5))
    assert run.returncode == 0, run.stderr[-2000:]
    return run_dir


def test_inspect_our_resume_file_and_lightning_ckpt(our_run: Path, tmp_path: Path) -> None:
    resume = our_run / "checkpoints" / "pretrain_64_resume.pth"
    info = json.loads(inspect(resume, "--json").stdout)
    # _resume.pth is a hard link to the newest checkpoint: Lightning's format with MiniMind's keys
    assert info["valid"] and info["format"] == "lightning" and info["written_by"] == "lit-minimind"
    assert info["minimind_keys"] and info["partial_gradients"] is False
    # a save is taken at an optimizer-step boundary: the training state holds each rank's RNG only (format 3)
    ckpt = torch.load(resume, weights_only=True, map_location="cpu")
    training = ckpt[TRAINING_STATE_KEY]
    assert training["format"] == TRAINING_STATE_FORMAT and training["world_size"] == 1
    assert [sorted(rank) for rank in training["ranks"]] == [["rng"]]
    assert {"torch", "python", "numpy"} <= training["ranks"][0]["rng"].keys()
    # a file of format 2 (written before) that lists a rank's gradients: inspect says so
    training.update(format=2, ranks=[{**training["ranks"][0], "grads": {"model.lm_head.weight": torch.ones(2)}}])
    torch.save(ckpt, tmp_path / "format2.ckpt")
    assert json.loads(inspect(tmp_path / "format2.ckpt", "--json").stdout)["partial_gradients"] is True
    assert (info["epoch"], info["step"], info["world_size"], info["global_step"]) == (0, 12, 1, 6)
    assert info["model_config"]["hidden_size"] == 64 and info["model_config"]["num_hidden_layers"] == 2
    assert info["parameters"] == 532832 and info["dtypes"] == {"float32": 25}
    assert info["optimizer"]["steps"] == 6 and info["fp32_master_weights"] and info["manifest"]
    assert info["versions"]["torch"]
    ckpt = next((our_run / "checkpoints").glob("*_s12_*.ckpt"))
    info = json.loads(inspect(ckpt, "--json").stdout)
    assert info["valid"] and info["format"] == "lightning" and info["global_step"] == 6 and info["step"] == 12
    table = inspect(ckpt)
    assert table.returncode == 0 and "lightning" in table.stdout


def test_inspect_original_minimind_files() -> None:
    need_shared()
    info = json.loads(inspect(MINIMIND / "original_run" / "checkpoints__pretrain_64_moe_resume.step5.pth", "--json").stdout)
    assert info["written_by"] == "original MiniMind" and info["step"] == 5 and info["wandb_id"] is None
    assert info["model_config"]["use_moe"] and info["model_config"]["num_experts"] == 4
    info = json.loads(inspect(MINIMIND / "original_run" / "out__pretrain_64.pth", "--json").stdout)
    assert info["format"] == "weights" and info["parameters"] == 532832  # MiniMind's "0.53M": tied head once


def test_inspect_reports_a_bad_file(tmp_path: Path) -> None:
    need_shared()
    bad = tmp_path / "cut.pth"
    bad.write_bytes((MINIMIND / "original_run" / "out__pretrain_64.pth").read_bytes()[:5000])
    result = inspect(bad, "--json")
    assert result.returncode == 1
    info = json.loads(result.stdout)
    assert info["valid"] is False and "truncated or corrupted" in info["error"]


# ----------------------------------------------------------------------------- not a checkpoint, integrity, scaler


def summarize(path: Path) -> dict:
    from lit_minimind.cli.inspect import summarize as summarize_

    return json.loads(json.dumps(summarize_(path), default=str))


def test_inspect_says_not_a_checkpoint_without_a_false_alarm(tmp_path: Path) -> None:
    import pickle

    files = {"config.json": json.dumps({"hidden_size": 64}).encode(), "README.md": b"# notes\n\nnot a model\n",
             "random.bin": bytes((i * 7919 + 13) % 251 for i in range(4096)),
             "data.pkl": pickle.dumps({"step": 3, "losses": [1.5, 1.2]}, protocol=4)}
    for name, content in files.items():
        (tmp_path / name).write_bytes(content)
        info = summarize(tmp_path / name)
        assert info["valid"] is False and "not a checkpoint" in info["error"], (name, info)
        assert "refused" not in info["error"]  # no security alarm for a file that is simply not a checkpoint
    result = inspect(tmp_path / "config.json", "--json")
    assert result.returncode == 1 and "not a checkpoint: JSON" in json.loads(result.stdout)["error"]


class _Hostile:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("protocol", [2, 4])
def test_inspect_refuses_a_plain_pickle_that_would_run_code(tmp_path: Path, protocol: int) -> None:
    import pickle

    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.pth"
    evil.write_bytes(pickle.dumps({"model": {}, "payload": _Hostile(str(marker))}, protocol=protocol))
    result = inspect(evil, "--json")
    info = json.loads(result.stdout)
    assert result.returncode == 1 and info["valid"] is False
    assert "refused to load" in info["error"] and "system" in info["error"]
    assert not marker.exists()


def test_inspect_catches_a_flipped_byte_without_a_manifest(tmp_path: Path) -> None:
    import shutil
    import zipfile

    need_shared()
    path = tmp_path / "out__pretrain_64.pth"
    shutil.copyfile(MINIMIND / "original_run" / "out__pretrain_64.pth", path)
    info = summarize(path)
    assert info["valid"] and info["verified"] and not info["manifest"]
    record = zipfile.ZipFile(path).getinfo("pretrain_64/data/1")
    data = bytearray(path.read_bytes())
    data[record.header_offset + 30 + len(record.filename) + 5] ^= 0x01  # a byte of torch's alignment padding
    path.write_bytes(bytes(data))
    torch.load(path, weights_only=True)  # torch reads it without complaint ...
    info = summarize(path)  # ... the verification does not
    assert info["valid"] is False and "truncated or corrupted" in info["error"] and "padding" in info["error"]
    data[record.header_offset + 30 + len(record.filename) + 5] ^= 0x01
    data[record.header_offset + 200] ^= 0x01  # a byte of the tensor's data
    path.write_bytes(bytes(data))
    info = summarize(path)
    assert info["valid"] is False and "CRC-32" in info["error"] and "pretrain_64/data/1" in info["error"]


def test_inspect_shows_the_scaler_of_any_precision_plugin(tmp_path: Path) -> None:
    from lightning.pytorch.plugins import MixedPrecision

    from lit_minimind.model.precision import CPUFloat16Mixed

    weights = {"model.head.weight": torch.zeros(8, 4)}
    plugins = (CPUFloat16Mixed(init_scale=1024.0),
               MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=256.0)))
    for plugin in plugins:
        key = type(plugin).__qualname__  # where Lightning's checkpoint connector stores the plugin's state
        ckpt = {"state_dict": weights, "pytorch-lightning_version": "2.6.6", "global_step": 0, key: plugin.state_dict()}
        path = tmp_path / f"{key}.ckpt"
        torch.save(ckpt, path)
        info = summarize(path)
        assert info["format"] == "lightning"
        assert info["scaler"] == {"scale": plugin.scaler.get_scale(), "growth_tracker": 0, "stored_under": key}
    resume = {"model": {"head.weight": torch.zeros(8, 4).half()}, "optimizer": None, "epoch": 0, "step": 1,
              "scaler": torch.amp.GradScaler("cpu", init_scale=64.0).state_dict()}
    torch.save(resume, tmp_path / "resume.pth")
    assert summarize(tmp_path / "resume.pth")["scaler"] == {"scale": 64.0, "growth_tracker": 0, "stored_under": "scaler"}
    torch.save({**resume, "scaler": {}}, tmp_path / "no_scaler.pth")  # MiniMind without a scaler: {}
    assert summarize(tmp_path / "no_scaler.pth")["scaler"] is None
