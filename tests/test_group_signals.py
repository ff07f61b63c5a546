"""A stop signal to the whole process group, as SLURM (``scancel``, preemption, the time limit) and a
terminal's Ctrl-C send it: DataLoader workers ignore it, the main process saves at the next optimizer
step and exits 0 with one line; the resume is exact. Workers still end when their parent dies."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import psutil
import pytest
import torch

from lit_minimind.checkpoint.read import verify_checkpoint
from lit_minimind.resume.start import resolve_last
from tests.helpers.runs import JOB_ID, SLURM, Run, Running, at_line, dataloader_workers, env_with, need_shared, run_cli, tiny_args

WORKERS = ["--data.num_workers", "2"]
STOP_MASK = (1 << (signal.SIGTERM - 1)) | (1 << (signal.SIGINT - 1)) | (1 << (signal.SIGUSR1 - 1))


def config(devices: int = 1) -> list[str]:
    return tiny_args(*WORKERS, epochs=2, accumulate=2, save_interval=100, devices=devices)


def ignored_signals(pid: int) -> int:
    """The process's ignored-signal mask (``SigIgn`` of /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return int(line.split()[1], 16)
    raise AssertionError(f"no SigIgn line for {pid}")


def run_group_signalled(cwd: Path, args: list[str], signum: int, after_lines: int,
                        env: dict[str, str] | None = None) -> tuple[Run, list[int]]:
    """Run the CLI in a session of its own; once its ``after_lines``-th console line is out, send
    ``signum`` to its whole process group (workers and DDP ranks included). Returns the run and the
    pids of the DataLoader workers alive when the signal went out (their ``SigIgn`` checked there)."""
    workers: list[psutil.Process] = []

    def signal_the_group(run: Running) -> None:
        workers.extend(dataloader_workers(run.proc.pid))
        assert workers, "no DataLoader worker process to signal"
        for worker in workers:
            assert ignored_signals(worker.pid) & STOP_MASK == STOP_MASK, f"worker {worker.pid} acts on stop signals"
        run.send(signum, group=True)

    run = run_cli(cwd, args, env=env, on_line=at_line(after_lines, signal_the_group))
    return run, [w.pid for w in workers]


def assert_stopped_cleanly(run: Run, run_dir: Path, signame: str, accumulate: int = 2) -> tuple[int, int]:
    """Exit 0, no worker death, one ``stopped by`` line, the stop's checkpoint committed at the last
    printed step (an optimizer-step boundary). Returns that step as (epoch, step), 1-based epoch."""
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Traceback" not in run.stderr and "killed by signal" not in run.stderr, run.stderr[-3000:]
    stops = [line for line in run.stderr.splitlines() if f"stopped by {signame}" in line]
    assert len(stops) == 1, run.stderr[-3000:]
    assert re.search(r"last save took \d+\.\d\d s until its files were committed", run.stderr)  # the grace it needs
    last_step = max(run.steps)
    assert last_step[1] % accumulate == 0, "must stop at an optimizer-step boundary"
    last = resolve_last(run_dir / "checkpoints", "pretrain_64")
    assert last is not None
    verify_checkpoint(last)
    saved = torch.load(run_dir / "checkpoints" / "pretrain_64_resume.pth", weights_only=True)
    assert (saved["epoch"] + 1, saved["step"]) == last_step
    assert last.name.startswith(f"pretrain_64_e{last_step[0] - 1}_s{last_step[1]}_")
    return last_step


def assert_resumes_exactly(run_dir: Path, args: list[str], stopped: Run, last_step: tuple[int, int],
                           ref: tuple[Path, dict], env: dict[str, str] | None = None) -> None:
    ref_dir, ref_steps = ref
    resumed = run_cli(run_dir, args + ["--ckpt_path", "last"], env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert min(resumed.steps) == (last_step[0], last_step[1] + 1), "resumed at the wrong position"
    assert max(resumed.steps) == max(ref_steps)
    for key, values in {**stopped.steps, **resumed.steps}.items():
        assert values == ref_steps[key], f"step {key} differs"
    ref_w = torch.load(ref_dir / "out" / "pretrain_64.pth", weights_only=True)
    got_w = torch.load(run_dir / "out" / "pretrain_64.pth", weights_only=True)
    assert all(torch.equal(ref_w[k], got_w[k]) for k in ref_w)


def reference_run(tmp_path_factory: pytest.TempPathFactory, devices: int) -> tuple[Path, dict]:
    need_shared()
    ref_dir = tmp_path_factory.mktemp(f"ref{devices}")
    ref = run_cli(ref_dir, config(devices))
    assert ref.returncode == 0, ref.stderr[-3000:]
    return ref_dir, ref.steps


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    return reference_run(tmp_path_factory, 1)


@pytest.fixture(scope="module")
def reference_ddp(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    return reference_run(tmp_path_factory, 2)


def test_sigterm_to_the_process_group_with_workers_saves_and_exits_zero(tmp_path: Path) -> None:
    need_shared()
    stopped, workers = run_group_signalled(tmp_path, config(), signal.SIGTERM, after_lines=3)
    assert_stopped_cleanly(stopped, tmp_path, "SIGTERM")
    assert stopped.stdout.count("SIGTERM received") == 1  # the main process's line; workers say nothing
    gone, alive = psutil.wait_procs([psutil.Process(p) for p in workers if psutil.pid_exists(p)], timeout=30)
    assert not alive, "DataLoader workers outlived the run"


@pytest.mark.slow
@pytest.mark.parametrize("signame", ["SIGTERM", pytest.param("SIGINT", marks=pytest.mark.matrix)])  # SIGINT: test-matrix
def test_group_signal_mid_epoch_then_exact_resume(tmp_path: Path, signame: str, reference: tuple[Path, dict]) -> None:
    stopped, _ = run_group_signalled(tmp_path, config() + ["--ckpt_path", "last"], getattr(signal, signame),
                                     after_lines=3)
    last_step = assert_stopped_cleanly(stopped, tmp_path, signame)
    assert last_step < (2, 12)
    assert_resumes_exactly(tmp_path, config(), stopped, last_step, reference)


@pytest.mark.slow
def test_sigusr1_to_the_process_group_under_slurm_requeues_then_exact_resume(tmp_path: Path,
                                                                            reference: tuple[Path, dict]) -> None:
    env, log = env_with(tmp_path, SLURM)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    stopped, _ = run_group_signalled(run_dir, config() + ["--ckpt_path", "last"], signal.SIGUSR1, after_lines=3,
                                     env=env)
    last_step = assert_stopped_cleanly(stopped, run_dir, "SIGUSR1")
    assert f"requeued job {JOB_ID}" in stopped.stdout
    assert [line for line in log.read_text().splitlines() if line.startswith("requeue")] == [f"requeue {JOB_ID}"]
    assert_resumes_exactly(run_dir, config(), stopped, last_step, reference, env=env)


@pytest.mark.slow
def test_sigterm_to_the_process_group_under_ddp_then_exact_resume(tmp_path: Path,
                                                                  reference_ddp: tuple[Path, dict]) -> None:
    """2 processes (Lightning's launcher: rank 1 is rank 0's child, in its group), 2 workers each."""
    stopped, workers = run_group_signalled(tmp_path, config(2) + ["--ckpt_path", "last"], signal.SIGTERM,
                                           after_lines=2)
    assert len(workers) == 4
    last_step = assert_stopped_cleanly(stopped, tmp_path, "SIGTERM")
    assert stopped.stdout.count("SIGTERM received") == 2  # one line per rank, none from the workers
    saved = torch.load(tmp_path / "checkpoints" / "pretrain_64_resume.pth", weights_only=True)
    assert saved["world_size"] == 2 and last_step < (2, 6)
    assert_resumes_exactly(tmp_path, config(2), stopped, last_step, reference_ddp)


@pytest.mark.slow
def test_workers_exit_when_their_parent_dies(tmp_path: Path) -> None:
    """SIGKILL to the main process alone: torch's worker loop sees its parent gone and ends."""
    need_shared()
    alive: list[psutil.Process] = []

    def kill_the_parent(line: str, run: Running) -> bool:
        if not run.console_lines:
            return False
        workers = dataloader_workers(run.proc.pid)
        assert workers
        run.proc.kill()
        run.proc.wait(timeout=60)
        alive.extend(psutil.wait_procs(workers, timeout=60)[1])
        return True  # done: what is left of the run is SIGKILLed

    run_cli(tmp_path, config(), on_line=kill_the_parent)
    assert not alive, f"workers {[p.pid for p in alive]} outlived their parent"
