"""``python -m lit_minimind.inspect``: a summary of any checkpoint, JSON for scripts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import MINIMIND, cli_env, need_shared, run_cli, tiny_args


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


def test_inspect_our_resume_file_and_lightning_ckpt(our_run: Path) -> None:
    info = json.loads(inspect(our_run / "checkpoints" / "pretrain_64_resume.pth", "--json").stdout)
    assert info["valid"] and info["format"] == "minimind_resume" and info["written_by"] == "lit-minimind"
    assert (info["epoch"], info["step"], info["world_size"], info["global_step"]) == (0, 12, 1, 6)
    assert info["model_config"]["hidden_size"] == 64 and info["model_config"]["num_hidden_layers"] == 2
    assert info["parameters"] == 532832 and info["dtypes"] == {"float16": 25}
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
