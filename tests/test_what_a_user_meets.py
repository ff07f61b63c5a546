"""What a user meets (issue 32): a mistyped flag, a file that is no model, the modes of written files,
and the lines a run ends with. Each check runs the real command in a subprocess on real files."""

from __future__ import annotations

import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.helpers.runs import at_line, cli_env, need_shared, run_cli, tiny_args


def run_module(module: str, *args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=cli_env(), capture_output=True,
                          text=True, timeout=timeout)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


# ------------------------------------------------------------------ no abbreviated flags
@pytest.mark.slow  # make test's budget: 14.6 min on a clean clone, 2026-12-03 (make test-slow)
def test_an_abbreviated_flag_is_an_unknown_flag_and_nothing_is_written(tmp_path: Path) -> None:
    """``--trainer.max_epoch`` is not taken for ``--trainer.max_epochs`` (argparse's allow_abbrev):
    one error line naming the flag meant, exit 2, before anything is written. ``--help`` still works."""
    run = run_module("lit_minimind.fit", "--trainer.max_epoch", "1", cwd=tmp_path)
    assert run.returncode == 2, run.stderr[-3000:]
    assert error_lines(run.stderr) == ["error: unknown flag --trainer.max_epoch (did you mean --trainer.max_epochs?)"]
    assert "Traceback" not in run.stderr and "lit-minimind summary" not in run.stdout
    assert not list(tmp_path.iterdir())  # no out/, checkpoints/, lightning_logs/
    shown = run_module("lit_minimind.fit", "--help", cwd=tmp_path)
    assert shown.returncode == 0 and "--trainer.max_epochs" in shown.stdout, shown.stderr[-3000:]


# ------------------------------------------------------------------ generate / export / inspect given no model
def not_model_files(where: Path) -> dict[str, tuple[Path, str]]:
    """Files that hold no model, as the library writes them: ``kind -> (file, what its error line must say)``."""
    import torch

    from lit_minimind.model import MiniMindConfig, MiniMindForCausalLM
    from lit_minimind.model.lora import apply_lora, lora_state

    torch.manual_seed(0)
    model = MiniMindForCausalLM(MiniMindConfig(hidden_size=64, num_hidden_layers=2))
    apply_lora(model)
    files = {"lora": where / "lora_x_64.pth", "optimizer": where / "optimizer.pth", "other": where / "notes.pth"}
    torch.save(lora_state(model.state_dict()), files["lora"])  # what LoRA training writes (out/lora_*.pth)
    torch.save(torch.optim.AdamW(model.parameters()).state_dict(), files["optimizer"])
    torch.save({"notes": "hello", "step": 3}, files["other"])
    return {
        "lora": (files["lora"], f"LoRA adapters only (4, rank 16), not a whole model: use them with the model they "
                 f"were trained on: python -m lit_minimind.generate BASE --lora {files['lora']}"),
        "optimizer": (files["optimizer"], f"{files['optimizer']}: an optimizer's state (state, param_groups), no model weights"),
        "other": (files["other"], f"{files['other']}: not model weights or a checkpoint (keys: notes, step)"),
    }


@pytest.mark.parametrize("kind", [pytest.param("lora", marks=pytest.mark.slow), "optimizer", "other"])  # lora: budget
def test_generate_export_inspect_say_what_a_file_without_a_model_is(tmp_path: Path, kind: str) -> None:
    """An adapter file, an optimizer's state dict, any other dict: each command prints one ``error:`` line
    saying what the file holds and what to do, exit 2, no traceback (generate: no ``Missing key(s)``)."""
    path, expected = not_model_files(tmp_path)[kind]
    commands = [("lit_minimind.generate", str(path), "--prompt", "hi"),
                ("lit_minimind.export", str(path), str(tmp_path / "hf")),
                ("lit_minimind.inspect", str(path))]
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = list(pool.map(lambda command: run_module(*command, cwd=tmp_path), commands))
    for command, run in zip(commands, runs):
        assert run.returncode == 2, (command[0], run.stdout[-2000:], run.stderr[-3000:])
        errors = error_lines(run.stderr)
        assert len(errors) == 1 and expected in errors[0], (command[0], run.stderr[-3000:])
        assert "Traceback" not in run.stderr and "Missing key" not in run.stderr, command[0]
    assert not (tmp_path / "hf").exists()


# ------------------------------------------------------------------ what a run writes is readable by others
@pytest.mark.slow  # make test's budget: 14.6 min on a clean clone, 2026-12-03 (make test-slow)
def test_weights_checkpoints_and_exports_get_the_umask_default_mode(tmp_path: Path) -> None:
    """Under umask 027 every file a run writes for its user (fp16 ``out/*.pth``, checkpoints, the Hugging
    Face export of ``--export_hf``, manifests) is 0o640 and the export directory 0o750, as ``open`` and
    ``mkdir`` make them; no file private to its owner (mkdtemp's and safetensors' 0o600 / 0o700)."""
    run = subprocess.run([sys.executable, "-m", "lit_minimind.fit", "--model.hidden_size", "64",
                          "--model.num_hidden_layers", "2", "--trainer.max_steps", "2", "--log_interval", "1",
                          "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
                          "--export_hf", "hf"], cwd=tmp_path, env=cli_env(), capture_output=True, text=True,
                         timeout=300, umask=0o027)
    assert run.returncode == 0, run.stderr[-3000:]
    files = [f for d in ("out", "checkpoints", "hf") for f in (tmp_path / d).rglob("*") if f.is_file()]
    names = {f.relative_to(tmp_path).as_posix() for f in files}
    assert {"out/pretrain_64.pth", "hf/model.safetensors", "hf/config.json"} <= names, names
    assert any(n.startswith("checkpoints/") and n.endswith(".ckpt") for n in names), names
    modes = {f.relative_to(tmp_path).as_posix(): oct(f.stat().st_mode & 0o777) for f in files}
    assert set(modes.values()) == {"0o640"}, modes
    assert oct((tmp_path / "hf").stat().st_mode & 0o777) == "0o750"


# ------------------------------------------------------------------ lines that say what happened
SMALL = ["--model.hidden_size", "64", "--model.num_hidden_layers", "2", "--log_interval", "1",
         "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]


def test_a_stop_signal_is_not_reported_as_max_epochs_reached(tmp_path: Path) -> None:
    """SIGTERM in the last epoch: "stopped by SIGTERM ..." and no "`Trainer.fit` stopped: `max_epochs=1`
    reached." after it (Lightning counts the epoch the signal cut short as processed)."""
    need_shared()
    run = run_cli(tmp_path, tiny_args(epochs=1, save_interval=100), on_line=at_line(3, lambda run: run.send(signal.SIGTERM)))
    assert run.returncode == 0, run.stderr[-3000:]
    assert "stopped by SIGTERM" in run.stderr, run.stderr[-3000:]
    assert max(run.steps) < (1, 12)  # stopped mid-epoch
    assert "`Trainer.fit` stopped" not in run.stderr + run.stdout, run.stderr[-3000:]


def test_invalid_json_line_says_at_once(tmp_path: Path) -> None:
    """Python's "Invalid control character at" message is not doubled: "... character at column 12"."""
    data = tmp_path / "bad.jsonl"
    data.write_text('{"text": "hello"}\n{"text": "a\tb"}\n')
    run = run_module("lit_minimind.fit", "--data.data_path", str(data), "--trainer.max_steps", "1", *SMALL, cwd=tmp_path)
    assert run.returncode == 2, run.stderr[-3000:]
    assert error_lines(run.stderr) == [f"error: {data}: line 2: not valid JSON (Invalid control character at column 12)"]


def test_a_run_that_trains_nothing_says_so_and_names_no_missing_directory(tmp_path: Path) -> None:
    """``--trainer.max_epochs 0``: the summary says nothing was trained and points at no checkpoint
    directory that was never created."""
    run = run_module("lit_minimind.fit", "--trainer.max_epochs", "0", "--resume.ckpt_dir", "ck0", *SMALL, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = run.stdout[run.stdout.index("== lit-minimind summary =="):]
    assert "nothing was trained in this run (0 batches)" in summary
    assert "resume checkpoints: - (none saved)" in summary and "ck0" not in summary, summary
    assert not (tmp_path / "ck0").exists()


@pytest.mark.slow  # make test-slow (budget)
def test_a_skipped_checkpoint_is_one_warning_line(tmp_path: Path) -> None:
    """The newest checkpoint damaged: ``--ckpt_path last`` skips it with one line, not Python's warning
    format with the source line (``rank_zero_warn(...)``) under it, and resumes from the one before."""
    args = [*SMALL, "--resume.save_interval", "1", "--resume.async_save", "false"]
    first = run_module("lit_minimind.fit", "--trainer.max_steps", "2", *args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    newest = max((tmp_path / "checkpoints").glob("*.ckpt"), key=lambda p: p.stat().st_mtime_ns)
    with open(newest, "r+b") as f:  # a flipped byte in the middle: its manifest's CRC-32 no longer matches
        f.seek(newest.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    again = run_module("lit_minimind.fit", "--trainer.max_steps", "3", "--ckpt_path", "last", *args, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    lines = again.stderr.splitlines()
    skipped = [i for i, line in enumerate(lines) if line.startswith(f"skipping checkpoint checkpoints/{newest.name}")]
    assert skipped, again.stderr[-3000:]  # the line itself: no file, line number or UserWarning in front
    assert "UserWarning" not in again.stderr, again.stderr[-3000:]
    assert "rank_zero_warn" not in again.stderr, again.stderr[-3000:]
    assert all(i + 1 == len(lines) or not lines[i + 1].startswith("  ") for i in skipped), again.stderr[-3000:]
