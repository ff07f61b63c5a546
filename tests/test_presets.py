"""``--config NAME``: the packaged presets (``lit_minimind/conf``, linked as the repository's ``conf/``) by name."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import lit_minimind
from lit_minimind.cli.presets import CONF_DIR, DEFAULT_CONFIG, preset_names, resolve_presets
from lit_minimind.errors import UsageError
from tests.helpers.runs import ROOT, cli_env

NAMES = sorted(p.stem for p in (ROOT / "conf").glob("*.yaml"))


def test_conf_is_the_package_s() -> None:
    assert (ROOT / "conf").is_symlink() and (ROOT / "conf").resolve() == CONF_DIR
    assert CONF_DIR == Path(lit_minimind.__file__).resolve().parent / "conf"
    assert DEFAULT_CONFIG == CONF_DIR / "default.yaml" and DEFAULT_CONFIG.is_file()
    assert "minimind_pretrain" in NAMES and preset_names() == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_every_preset_by_name(name: str) -> None:
    path = str(CONF_DIR / f"{name}.yaml")
    assert resolve_presets(["--config", name, "--trainer.max_steps", "3"]) == ["--config", path, "--trainer.max_steps", "3"]
    assert resolve_presets([f"--config={name}"]) == [f"--config={path}"]
    assert resolve_presets(["-c", name]) == ["-c", path]


@pytest.mark.parametrize("value", ["conf/minimind_pretrain.yaml", "minimind_pretrain.yaml", "/abs/x.yaml",
                                   "{model: {hidden_size: 64}}", "model:\n  hidden_size: 64"])
def test_paths_and_inline_configs_pass_through(value: str) -> None:
    assert resolve_presets(["--config", value]) == ["--config", value]
    assert resolve_presets([f"--config={value}"]) == [f"--config={value}"]


def test_an_existing_file_wins_over_a_preset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "minimind_pretrain").write_text("model:\n  hidden_size: 64\n")
    assert resolve_presets(["--config", "minimind_pretrain"]) == ["--config", "minimind_pretrain"]


def test_an_unknown_name_lists_the_presets() -> None:
    with pytest.raises(UsageError) as err:
        resolve_presets(["--trainer.max_steps", "3", "--config", "minimind_pretrian"])
    assert str(err.value).startswith("--config minimind_pretrian: ")
    assert all(name in str(err.value) for name in NAMES)


@pytest.mark.slow  # make test's budget: 14.6 min on a clean clone, 2026-12-03 (make test-slow)
def test_cli_by_name(tmp_path: Path) -> None:
    """From a directory without conf/: an unknown name is one error line (exit 2); a known one loads, and
    MiniMind's flags still override it (translate moves the preset first)."""
    bad = subprocess.run([sys.executable, "-m", "lit_minimind.fit", "--config", "nope"], cwd=tmp_path, env=cli_env(),
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2, bad.stderr[-2000:]
    errors = [line for line in bad.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("error: --config nope: ") and "minimind_pretrain" in errors[0], errors
    good = subprocess.run([sys.executable, "-m", "lit_minimind.fit", "--epochs", "1", "--config=minimind_pretrain",
                           "--print_config"], cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=120)
    assert good.returncode == 0, good.stderr[-2000:]
    assert good.stdout.startswith("MiniMind flags: --epochs 1 -> --trainer.max_epochs 1\n"), good.stdout[:300]
    used = yaml.safe_load(good.stdout.split("\n", 1)[1])
    assert used["model"]["hidden_size"] == 768 and used["trainer"]["max_epochs"] == 1
    assert used["trainer"]["precision"] == "bf16-mixed"
