"""Shared helpers: paths to ../shared, and running the real CLI in a subprocess."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
MINIMIND = SHARED / "minimind"
TINY_JSONL = MINIMIND / "original_run" / "tiny.jsonl"
TOKENIZER = MINIMIND / "tokenizer"

LINE_RE = re.compile(
    # MiniMind's line; its DPO line (train_dpo.py) says dpo_loss and learning_rate
    r"Epoch:\[(\d+)/(\d+)\]\((\d+)/(\d+)\), loss: ([\d.]+), (?:logits_loss|dpo_loss): ([\d.]+), aux_loss: ([\d.]+), "
    r"(?:lr|learning_rate): ([\d.]+), epoch_time: ([\d.]+)min"
)


def need_shared() -> None:
    if not MINIMIND.exists():
        pytest.skip(f"reference data not found at {MINIMIND} (../shared is absent)")


def tiny_args(*extra: str, epochs: int = 1, accumulate: int = 2, save_interval: int = 5, moe: bool = False,
              devices: int = 1) -> list[str]:
    """MiniMind's original_run config (runs.json argv) as our CLI flags."""
    return [
        "--data.data_path", str(TINY_JSONL), "--data.tokenizer_path", str(TOKENIZER),
        "--model.hidden_size", "64", "--model.num_hidden_layers", "2", f"--model.use_moe={str(moe).lower()}",
        "--data.max_seq_len", "64", "--data.batch_size", "4", "--model.learning_rate", "5e-4",
        "--trainer.accumulate_grad_batches", str(accumulate), "--trainer.gradient_clip_val", "1.0",
        "--trainer.max_epochs", str(epochs), "--trainer.accelerator", "cpu", "--trainer.devices", str(devices),
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
        "--log_interval", "1", "--resume.save_interval", str(save_interval),
        *(["--trainer.strategy", "ddp"] if devices > 1 else []), *extra,
    ]


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    lines: list[tuple] = field(default_factory=list)

    @property
    def steps(self) -> dict[tuple[int, int], tuple[str, ...]]:
        """(epoch, step) -> printed (loss, logits_loss, aux_loss, lr)."""
        return {(int(m[0]), int(m[2])): (m[4], m[5], m[6], m[7]) for m in self.lines}


def cli_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIT_MINIMIND_TEST")}
    # tests/helpers/site: its sitecustomize installs the test-only fault injection (tests/helpers/faults.py)
    env.update({"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests" / "helpers" / "site")]), "WANDB_MODE": "offline", "LIT_MINIMIND_CACHE": str(ROOT / ".cache"),
                "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
                "OMP_NUM_THREADS": "1", **extra})  # 1 thread: tests run side by side on 2 cores
    return env


def run_cli(cwd: Path, args: list[str], *, kill_after_lines: int | None = None, env: dict[str, str] | None = None,
            timeout: float = 300, kill_group: bool = True) -> Run:
    """Run ``python -m lit_minimind.fit`` in ``cwd``.

    ``kill_after_lines=k`` sends SIGKILL right after the k-th MiniMind console line is read;
    a process that stops itself inside a save (test hook) is SIGKILLed there. ``kill_group``
    kills every process of the run (DDP ranks, wandb's service), else only the trainer process.
    """
    # own session: a kill takes the whole process group (DDP ranks included), as a preemption does
    proc = subprocess.Popen([sys.executable, "-m", "lit_minimind.fit", *args], cwd=cwd, env=env or cli_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    out: list[str] = []
    seen = 0
    assert proc.stdout is not None
    for line in proc.stdout:
        out.append(line)
        if LINE_RE.search(line):
            seen += 1
        if line.startswith(("@@stopped-in-save", "@@stopped-after-save")) or (kill_after_lines is not None and seen >= kill_after_lines):
            (os.killpg if kill_group else os.kill)(proc.pid, signal.SIGKILL)
            break
    try:
        rest, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        rest, err = proc.communicate()
    stdout = "".join(out) + (rest or "")
    return Run(proc.returncode, stdout, err, LINE_RE.findall(stdout))
