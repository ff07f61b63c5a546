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


MUTANTS = ROOT / "tests" / "mutants"  # scripts/mutants.py: deliberate breaks, chosen by LIT_MINIMIND_MUTANT


def cli_env(**extra: str) -> dict[str, str]:
    """The CLI's environment; with ``LIT_MINIMIND_MUTANT`` set (``make test-mutants``) its sitecustomize
    goes first on ``PYTHONPATH``, so the break applies in every process a test starts."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIT_MINIMIND_TEST")}
    # tests/helpers/site: its sitecustomize installs the test-only fault injection (tests/helpers/faults.py);
    # a mutant's (tests/mutants) goes before it and runs it too
    path = [str(ROOT), str(ROOT / "tests" / "helpers" / "site")]
    if env.get("LIT_MINIMIND_MUTANT"):
        path.insert(0, str(MUTANTS))
    env.update({"PYTHONPATH": os.pathsep.join(path), "WANDB_MODE": "offline", "LIT_MINIMIND_CACHE": str(ROOT / ".cache"),
                "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
                "OMP_NUM_THREADS": "1", **extra})  # 1 thread: tests run side by side on 2 cores
    return env


def run_cli(cwd: Path, args: list[str], *, kill_after_lines: int | None = None, env: dict[str, str] | None = None,
            timeout: float = 300, kill_group: bool = True, command: list[str] | None = None) -> Run:
    """Run ``python -m lit_minimind.fit`` (or ``command``, e.g. ``[python, script.py]``) in ``cwd``.

    ``kill_after_lines=k`` sends SIGKILL right after the k-th MiniMind console line is read;
    a process that stops itself inside a save (test hook) is SIGKILLed there. ``kill_group``
    kills every process of the run (DDP ranks, wandb's service), else only the trainer process.
    """
    # own session: a kill takes the whole process group (DDP ranks included), as a preemption does
    proc = subprocess.Popen([*(command or [sys.executable, "-m", "lit_minimind.fit"]), *args], cwd=cwd, env=env or cli_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    out: list[str] = []
    seen = 0
    assert proc.stdout is not None
    for line in proc.stdout:
        out.append(line)
        if LINE_RE.search(line):
            seen += 1
        # "in", not "starts with": the writer thread's @@ line can land inside a console line the main
        # thread is printing at that moment (print writes text and newline separately)
        stopped = "@@stopped-in-save" in line or "@@stopped-after-save" in line
        if stopped or (kill_after_lines is not None and seen >= kill_after_lines):
            (os.killpg if kill_group else os.kill)(proc.pid, signal.SIGKILL)
            break
    try:
        rest, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        rest, err = proc.communicate()
    stdout = "".join(out) + (rest or "")
    return Run(proc.returncode, stdout, err, LINE_RE.findall(stdout))

RESUME_RE = re.compile(r"resuming epoch (\d+) at step (\d+)/(\d+): skipping (\d+) trained batches"
                       r"|resuming at the start of epoch (\d+)")


def resumed_at(run: Run | str) -> tuple[int, int] | None:
    """The 1-based ``(epoch, step)`` of the first batch a run's resume line names (``step`` 1 at the
    start of an epoch), or ``None`` if the run did not resume. The last such line of the run counts
    (torchrun's restarted attempt prints its own)."""
    text = run if isinstance(run, str) else run.stderr + run.stdout
    found = RESUME_RE.findall(text)
    if not found:
        return None
    epoch, step, _iters, skipped, start = found[-1]
    if start:
        return int(start), 1
    assert int(skipped) == int(step) - 1, f"resume line: step {step} but {skipped} skipped"
    return int(epoch), int(step)


def assert_resumed(run: Run | str, epoch: int, step: int, *, lines: dict | None = None) -> None:
    """The run resumed at 1-based ``epoch``/``step`` (the first batch it trains; ``step=1``: the start of
    the epoch, nothing skipped), and the first console line it printed (if any) is that batch.

    ``lines``: the run's ``steps`` when they come from elsewhere (several processes' stdout)."""
    where = resumed_at(run)
    text = run if isinstance(run, str) else run.stderr
    assert where is not None, f"the run did not resume (no 'resuming ...' line):\n{text[-2000:]}"
    assert where == (epoch, step), f"resumed at epoch {where[0]} step {where[1]}, expected epoch {epoch} step {step}"
    printed = lines if lines is not None else (run.steps if isinstance(run, Run) else {})
    if printed:
        assert min(printed) == (epoch, step), f"first trained step {min(printed)} != resume position {(epoch, step)}"


def expected_resume(run_dir: Path, stem: str = "pretrain_64", iters: int = 12) -> tuple[int, int] | None:
    """Where ``--ckpt_path last`` must resume in ``run_dir`` (same world size): the 1-based ``(epoch, step)``
    after the checkpoint ``last`` names now (read before the run), ``None`` if there is none."""
    import torch

    from lit_minimind.callbacks.files import resolve_last

    last = resolve_last(run_dir / "checkpoints", stem)
    if last is None:
        return None
    saved = torch.load(last, weights_only=True, map_location="cpu")
    epoch, step = int(saved["epoch"]), int(saved["step"])
    return (epoch + 2, 1) if step >= iters else (epoch + 1, step + 1)


def readme_script(*edits: tuple[str, str] | None) -> str:
    """The python block of the README's section "In your own Lightning script", with ``edits`` (old, new)."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## In your own Lightning script"):]
    text = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    for old, new in filter(None, edits):
        assert old in text, f"the README's script no longer has {old!r}"
        text = text.replace(old, new)
    return text


def pytest_terminal_summary(terminalreporter) -> None:  # noqa: ANN001
    """Say at the end of a run how many tests skipped because ``../shared`` is not beside the checkout."""
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if "../shared is absent" in str(r.longrepr)]
    if skipped:
        terminalreporter.write_line(f"{len(skipped)} tests skipped: MiniMind's reference data ({MINIMIND}) is absent; "
                                    "put the project's shared/ folder beside the checkout to run them")
