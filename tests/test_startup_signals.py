"""A stop signal at any moment of start-up ends with exit 0, one line saying so, and nothing lost:
the run resumed afterwards ends exactly like the run never interrupted.

Also during the seconds of imports of ``python -m lit_minimind.fit`` (torch, Lightning): exit 0 and one
line, no traceback (``lit_minimind/fit.py`` handles the signals from its first line); and what
``import lit_minimind`` and the other entry points no longer import (Lightning; matplotlib for fit).
There, ``python -X importtime`` writes a line to stderr as each module finishes importing, so the test
knows the process is inside its imports when it sends the signal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.runs import assert_resumed, cli_env, need_shared, resumed_at, run_cli, tiny_args

# `make test-slow`: restore, after it (before Lightning's handlers) and as training starts; before restore and while
# the loader is built behave like restore itself: `make test-matrix`
PHASES = [pytest.param(p, marks=pytest.mark.matrix if p in ("setup", "train_dataloader") else pytest.mark.slow)
          for p in ("setup", "on_load_checkpoint", "on_fit_start", "train_dataloader", "on_train_batch_start")]


def signal_at(phase: str, signame: str = "SIGTERM") -> list[str]:
    return ["--trainer.callbacks+=tests.helpers.signal_at.SignalAt", f"--trainer.callbacks.phase={phase}",
            f"--trainer.callbacks.signame={signame}"]


@pytest.mark.parametrize("phase", PHASES)
def test_signal_during_start_up_of_a_resume(tmp_path: Path, phase: str) -> None:
    need_shared()
    args = tiny_args(epochs=1, accumulate=2, save_interval=4)
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    ref_dir.mkdir(), run_dir.mkdir()
    ref = run_cli(ref_dir, args)
    assert ref.returncode == 0, ref.stderr[-3000:]
    # killed right after the step-4 save's last file (its export, the 3rd commit)
    first = run_cli(run_dir, args, env=cli_env(LIT_MINIMIND_TEST_STOP_AFTER_SAVE="1:export"))
    assert first.returncode == -9 and "@@stopped-after-save" in first.stdout
    files = {p.name: p.read_bytes() for p in (run_dir / "checkpoints").glob("*.ckpt")}

    stopped = run_cli(run_dir, args + ["--ckpt_path", "last", *signal_at(phase)])
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert "Traceback" not in stopped.stderr
    assert "SIGTERM received" in stopped.stdout
    assert len([line for line in stopped.stderr.splitlines() if "stopped by SIGTERM" in line]) == 1, stopped.stderr[-2000:]
    if phase in ("on_fit_start", "train_dataloader", "on_train_batch_start") or resumed_at(stopped):  # restored
        assert_resumed(stopped, 1, 5)
    if phase != "on_train_batch_start":  # nothing trained: the checkpoints are the same files
        assert not stopped.steps
        assert {p.name: p.read_bytes() for p in (run_dir / "checkpoints").glob("*.ckpt")} == files
    else:  # the first batch's window completes, is saved, then the run stops
        assert sorted(stopped.steps) == [(1, 5), (1, 6)]

    done = run_cli(run_dir, args + ["--ckpt_path", "last"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert_resumed(done, 1, 7 if phase == "on_train_batch_start" else 5)
    for run in (first, stopped, done):
        for key, values in run.steps.items():
            assert values == ref.steps[key], key
    ref_w = torch.load(ref_dir / "out" / "pretrain_64.pth", weights_only=True)
    got_w = torch.load(run_dir / "out" / "pretrain_64.pth", weights_only=True)
    assert all(torch.equal(ref_w[k], got_w[k]) for k in ref_w)


@pytest.mark.parametrize("phase", ["setup", "train_dataloader"])
def test_signal_during_start_up_of_a_fresh_run(tmp_path: Path, phase: str) -> None:
    need_shared()
    run = run_cli(tmp_path, tiny_args(epochs=1) + signal_at(phase, "SIGUSR1"))
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Traceback" not in run.stderr and "stopped by SIGUSR1" in run.stderr
    assert not run.steps and not list((tmp_path / "checkpoints").glob("*.ckpt"))


# ---------------------------------------------------------------------------------------------------
# During the imports of python -m lit_minimind.fit

LINE = "during start-up; nothing trained, nothing to save"


def imported(line: str) -> str | None:
    """The module an ``-X importtime`` line reports (None for any other line)."""
    return line.rsplit("|", 1)[1].strip() if line.startswith("import time:") and "|" in line else None


def signal_during_imports(cwd: Path, sends: list[tuple[str, int]], args: tuple[str, ...] = ("--help",),
                          env: dict[str, str] | None = None) -> tuple[int, str, list[str], str]:
    """Start ``python -X importtime -m lit_minimind.fit ARGS`` and send each signal once the module named
    with it has been imported (every one is imported after ``lit_minimind/fit.py`` began, well before its
    imports end). Returns the exit code, stdout, the modules imported (in order) and stderr without them."""
    with open(cwd / "stdout.txt", "w+") as stdout:  # a file: it never fills while stderr is read
        proc = subprocess.Popen([sys.executable, "-X", "importtime", "-m", "lit_minimind.fit", *args], cwd=cwd,
                                env=env or cli_env(), stdout=stdout, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)  # a signal of ours never reaches pytest's group
        assert proc.stderr is not None
        pending, modules, other = list(sends), [], []
        for line in proc.stderr:
            module = imported(line)
            if module is None:
                other.append(line)
                continue
            modules.append(module)
            if pending and module == pending[0][0]:
                os.kill(proc.pid, pending.pop(0)[1])
        proc.wait(timeout=300)
        stdout.seek(0)
        out = stdout.read()
    assert not pending, f"never imported: {pending}"
    return proc.returncode, out, modules, "".join(other)


@pytest.mark.parametrize(("signame", "marker"), [("SIGTERM", "torch.version"), ("SIGINT", "torch"),
                                                 pytest.param("SIGUSR1", "lightning.fabric", marks=pytest.mark.slow)])
def test_stop_signal_during_imports_exits_zero_with_one_line(tmp_path: Path, signame: str, marker: str) -> None:
    code, out, modules, err = signal_during_imports(tmp_path, [(marker, getattr(signal, signame))])
    assert code == 0, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert err.strip().splitlines() == [f"stopped by {signame} {LINE}"], err[-3000:]
    assert "usage:" not in out  # nothing parsed, nothing built
    assert modules.index(marker) < modules.index("lit_minimind.cli.fit")  # sent while the imports went on
    # fit imports no plotting (torchmetrics' .plot() support, switched off by lit_minimind/fit.py)
    assert not {"matplotlib", "matplotlib.pyplot", "mpl_toolkits.mplot3d"} & set(modules)


def test_second_sigint_during_imports_aborts_at_once(tmp_path: Path) -> None:
    code, out, modules, err = signal_during_imports(tmp_path, [("torch.version", signal.SIGINT), ("torch", signal.SIGINT)])
    assert code == 130, err[-3000:]
    assert "second SIGINT: aborting now, without saving" in out
    assert "Traceback" not in err, err[-3000:]
    assert "lit_minimind.cli.fit" not in modules  # it did not wait for the imports


def test_sigusr1_during_imports_under_slurm_stops_before_the_first_batch_then_requeues(tmp_path: Path) -> None:
    """SIGUSR1 under SLURM (the time limit is near) is not ended at once: the run goes on to stop before
    the first batch, so that ``requeue_if_preempted`` requeues the job as for SIGUSR1 later in start-up."""
    need_shared()
    bin_dir, log = tmp_path / "bin", tmp_path / "scontrol.log"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text('#!/bin/sh\necho "$*" >> "$SCONTROL_LOG"\n')
    (bin_dir / "scontrol").chmod(0o755)
    env = {k: v for k, v in cli_env().items() if not k.startswith("SLURM_")}
    env.update(SLURM_JOB_ID="4242", SLURM_JOB_NAME="train", SLURM_NTASKS="1", SLURM_NTASKS_PER_NODE="1",
               SLURM_NNODES="1", SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0", SLURM_NODELIST="localhost",
               PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", SCONTROL_LOG=str(log))
    code, out, modules, err = signal_during_imports(tmp_path, [("torch.version", signal.SIGUSR1)],
                                                    tuple(tiny_args(epochs=1)), env)
    assert code == 0, err[-3000:]
    assert "Traceback" not in err and LINE not in err, err[-3000:]
    assert [line for line in err.splitlines() if "stopped by" in line] == [
        "stopped by SIGUSR1 before the first batch; nothing new to save. Resume with the same command plus --ckpt_path last"]
    assert "requeued job 4242" in out, out[-3000:]
    assert log.read_text().splitlines() == ["requeue 4242"]
    assert not list((tmp_path / "checkpoints").glob("*.ckpt"))


def test_entry_points_import_no_lightning(tmp_path: Path) -> None:
    check = ("import sys\n"
             "import lit_minimind\n"
             "assert 'torch' not in sys.modules, 'import lit_minimind imports torch'\n"
             "from lit_minimind import MiniMindConfig, MiniMindForCausalLM, SkipBatchSampler, checkpoint_paths\n"
             "from lit_minimind import load_resume_checkpoint, save_resume_checkpoint\n"
             "import lit_minimind.inspect, lit_minimind.export, lit_minimind.generate, lit_minimind.merge_lora\n"
             "import lit_minimind.serve, lit_minimind.eval\n"
             "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning'))\n"
             "assert not bad, bad[:5]\n")
    run = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, env=cli_env(), capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    # and running one: python -m lit_minimind.inspect --help
    run = subprocess.run([sys.executable, "-X", "importtime", "-m", "lit_minimind.inspect", "--help"], cwd=tmp_path,
                         env=cli_env(), capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    modules = {imported(line) for line in run.stderr.splitlines()} - {None}
    assert "lit_minimind.cli.inspect" in modules
    assert not {m for m in modules if m.split(".")[0] in ("lightning", "pytorch_lightning")}


def test_which_early_stops_end_the_process_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Alone: at once. One of several processes launched together, or SIGUSR1 under SLURM (its requeue
    needs the trainer): the run goes on to where every rank agrees (before the first batch)."""
    from lit_minimind.callbacks.preemption import stops_at_once

    for name in ("WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "MASTER_ADDR", "TORCHELASTIC_RUN_ID", "SLURM_NTASKS",
                 "SLURM_JOB_ID", "SLURM_JOB_NAME"):
        monkeypatch.delenv(name, raising=False)
    assert not stops_at_once(None)
    assert all(stops_at_once(name) for name in ("SIGTERM", "SIGINT", "SIGUSR1"))
    for name, value in [("WORLD_SIZE", "2"), ("LOCAL_RANK", "0"), ("NODE_RANK", "1"), ("MASTER_ADDR", "node0"),
                        ("TORCHELASTIC_RUN_ID", "x"), ("SLURM_NTASKS", "4")]:
        with monkeypatch.context() as env:
            env.setenv(name, value)
            assert not stops_at_once("SIGTERM"), name
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert stops_at_once("SIGTERM")
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_NTASKS", "1")
    monkeypatch.setenv("SLURM_JOB_NAME", "train")
    assert stops_at_once("SIGTERM")  # scancel: nothing to requeue
    assert not stops_at_once("SIGUSR1")  # the time limit: requeued after the stop, as later in start-up
