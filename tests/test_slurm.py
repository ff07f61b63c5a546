"""SLURM: ``#SBATCH --signal=USR1@90`` makes the run save an exact checkpoint at the next optimizer
step, then global rank 0 runs ``scontrol requeue $SLURM_JOB_ID`` (a fake one here, recording its
arguments) and exits 0; the requeued job (same command, ``--ckpt_path last``) resumes exactly.
Outside SLURM, and for SIGTERM, SIGUSR1 keeps meaning "save and stop": no requeue."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.plugins.environments import SLURMEnvironment

from lit_minimind.callbacks.preemption import STOP, cluster_plugins, slurm_job_id, under_slurm
from tests.helpers.runs import (
    JOB_ID,
    SLURM,
    Run,
    assert_resumed,
    at_line,
    cli_env,
    env_with,
    free_port,
    need_shared,
    run_cli,
    tiny_args,
)


def run_signalled(cwd: Path, args: list[str], env: dict[str, str], after_lines: int, signum: int) -> Run:
    """The CLI, sent ``signum`` (its first process only) right after its ``after_lines``-th console line."""
    return run_cli(cwd, args, env=env, on_line=at_line(after_lines, lambda run: run.send(signum)))


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "out" / "pretrain_64.pth", weights_only=True)


def test_sigusr1_under_slurm_saves_then_requeues_and_the_requeued_job_resumes_exactly(tmp_path: Path) -> None:
    need_shared()
    args = tiny_args(epochs=2, accumulate=2, save_interval=100)
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    ref_dir.mkdir(), run_dir.mkdir()
    ref = run_cli(ref_dir, args)
    assert ref.returncode == 0, ref.stderr[-3000:]

    env, log = env_with(tmp_path, SLURM)
    stopped = run_signalled(run_dir, args + ["--ckpt_path", "last"], env, after_lines=3, signum=signal.SIGUSR1)
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert "SIGUSR1 received" in stopped.stdout
    assert f"requeued job {JOB_ID}" in stopped.stdout
    last_step = max(stopped.steps)
    assert last_step[1] % 2 == 0 and last_step < (2, 12), "must stop at an optimizer-step boundary, mid-run"
    # scontrol ran once, on a committed checkpoint of the stop's step (no tmp file left: the write was over)
    recorded = log.read_text().splitlines()
    assert recorded[0] == f"requeue {JOB_ID}"
    assert sum(line.startswith("requeue") for line in recorded) == 1
    stop_ckpt = f"pretrain_64_e{last_step[0] - 1}_s{last_step[1]}_"
    assert any(line.startswith(stop_ckpt) and line.endswith(".ckpt") for line in recorded[1:]), recorded
    assert "pretrain_64_resume.pth" in recorded[1:] and not any(line.endswith(".tmp") for line in recorded)
    assert not list(run_dir.rglob("hpc_ckpt*")), "Lightning's own SLURM handler saved a checkpoint"

    # the requeued job: the same command in the same environment
    resumed = run_cli(run_dir, args + ["--ckpt_path", "last"], env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_resumed(resumed, last_step[0], last_step[1] + 1)
    for key, values in {**stopped.steps, **resumed.steps}.items():
        assert values == ref.steps[key], f"step {key} differs"
    ref_w, got_w = weights(ref_dir), weights(run_dir)
    assert all(torch.equal(ref_w[k], got_w[k]) for k in ref_w)
    assert sum(line.startswith("requeue") for line in log.read_text().splitlines()) == 1  # finished: no requeue


@pytest.mark.parametrize(("where", "signame"), [("outside SLURM", "SIGUSR1"), ("under SLURM", "SIGTERM")])
def test_no_requeue_outside_slurm_or_for_sigterm(tmp_path: Path, where: str, signame: str) -> None:
    need_shared()
    env, log = env_with(tmp_path, SLURM if where == "under SLURM" else None)
    stopped = run_signalled(tmp_path, tiny_args(epochs=2, save_interval=100), env, after_lines=2,
                            signum=getattr(signal, signame))
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert f"stopped by {signame}" in stopped.stderr
    assert (tmp_path / "checkpoints" / "pretrain_64_resume.pth").exists()
    assert not log.exists(), "scontrol was called"
    assert "requeue" not in stopped.stdout


@pytest.mark.slow  # make test's budget: 14.6 min on a clean clone, 2026-12-03 (make test-slow)
def test_sigusr1_on_one_slurm_task_of_two_stops_both_and_only_rank_0_requeues(tmp_path: Path) -> None:
    """Two tasks as ``srun --ntasks-per-node=2`` starts them (Lightning's SLURMEnvironment, DDP on
    gloo); SIGUSR1 reaches rank 1 only: the ranks agree to stop, rank 0 requeues once."""
    need_shared()
    port = free_port()
    args = tiny_args("--ckpt_path", "last", epochs=2, accumulate=2, save_interval=100, devices=2)
    envs = []
    for rank in (0, 1):
        env, log = env_with(tmp_path, {**SLURM, "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2",
                                       "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank),
                                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
        envs.append(env)
    with open(tmp_path / "task1.out", "w+") as out1, open(tmp_path / "task1.err", "w+") as err1:
        task1 = subprocess.Popen([sys.executable, "-m", "lit_minimind.fit", *args], cwd=tmp_path, env=envs[1], text=True,
                                 stdout=out1, stderr=err1, start_new_session=True)
        try:
            # rank 0 read as it runs: the signal to task 1 right after rank 0's 2nd console line
            task0 = run_cli(tmp_path, args, env=envs[0], timeout=240,
                            on_line=at_line(2, lambda run: os.kill(task1.pid, signal.SIGUSR1)))
            codes = [task0.returncode, task1.wait(timeout=240)]
        finally:
            if task1.poll() is None:
                task1.kill()
        out1.seek(0), err1.seek(0)
        task1_out, task1_err = out1.read(), err1.read()
    assert codes == [0, 0], task0.stderr[-3000:] + task1_err[-3000:]
    assert "SIGUSR1 received" in task1_out and "SIGUSR1 received" not in task0.stdout
    assert f"requeued job {JOB_ID}" in task0.stdout and "requeued" not in task1_out
    assert [line for line in log.read_text().splitlines() if line.startswith("requeue")] == [f"requeue {JOB_ID}"]
    resume = torch.load(tmp_path / "checkpoints" / "pretrain_64_resume.pth", weights_only=True)
    assert resume["world_size"] == 2 and resume["step"] % 2 == 0 and (resume["epoch"], resume["step"]) < (1, 6)


def test_slurm_detection_and_job_id(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in [k for k in os.environ if k.startswith(("SLURM_", "TORCHELASTIC_"))]:
        monkeypatch.delenv(key)
    assert not under_slurm() and cluster_plugins([]) == []
    for key, value in SLURM.items():
        monkeypatch.setenv(key, value)
    assert under_slurm() and slurm_job_id() == JOB_ID
    (plugin,) = cluster_plugins([])
    assert isinstance(plugin, SLURMEnvironment) and plugin.auto_requeue is False
    assert cluster_plugins([SLURMEnvironment()]) == []  # the user's own choice wins
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "77")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    assert slurm_job_id() == "77_3"
    monkeypatch.setenv("SLURM_JOB_NAME", "interactive")  # salloc + a shell: Lightning leaves it alone, so do we
    assert not under_slurm() and cluster_plugins([]) == []
    monkeypatch.setenv("SLURM_JOB_NAME", "train")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")  # torchrun inside the job: Lightning prefers torchrun's ranks
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "GROUP_RANK": "0",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    assert cluster_plugins([]) == []


def test_the_cli_gives_lightning_a_slurm_environment_without_auto_requeue(monkeypatch: pytest.MonkeyPatch,
                                                                         tmp_path: Path) -> None:
    """Under SLURM the Trainer gets ``SLURMEnvironment(auto_requeue=False)``: Lightning registers no
    SIGUSR1 handler of its own (no ``hpc_ckpt_*.ckpt``, no second requeue)."""
    need_shared()
    for key in [k for k in os.environ if k.startswith(("SLURM_", "TORCHELASTIC_"))]:
        monkeypatch.delenv(key)
    for key, value in {**SLURM, "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false",
                       "WANDB__TRANSACTION_LOG_FLUSH_INTERVAL": "1"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)
    seen = {}
    monkeypatch.setattr(pl.Trainer, "fit", lambda self, *a, **k: seen.setdefault(
        "env", self._accelerator_connector.cluster_environment))
    from lit_minimind.cli.fit import main

    try:
        assert main(tiny_args(epochs=1)) == 0
    finally:
        STOP.uninstall()
    assert isinstance(seen["env"], SLURMEnvironment) and seen["env"].auto_requeue is False


def test_the_sbatch_template_asks_for_the_signal_and_requeue_and_its_flags_parse(tmp_path: Path) -> None:
    """scripts/slurm_pretrain.sbatch under a fake ``srun`` that prints the resolved config."""
    root = Path(__file__).resolve().parents[1]
    template = root / "scripts" / "slurm_pretrain.sbatch"
    sbatch = [line.split()[1] for line in template.read_text().splitlines() if line.startswith("#SBATCH")]
    assert "--signal=USR1@90" in sbatch and "--requeue" in sbatch
    assert not any(opt.startswith("--job-name=") and opt.split("=")[1] in ("bash", "interactive") for opt in sbatch)
    srun = tmp_path / "srun"
    srun.write_text('#!/bin/sh\nwhile [ "${1#-}" != "$1" ]; do shift; done\nexec "$@" --print_config\n')
    srun.chmod(0o755)
    env = {k: v for k, v in cli_env().items() if not k.startswith("SLURM_")}
    env.update(SLURM, SLURM_NNODES="2", SLURM_NTASKS_PER_NODE="8", SLURM_NTASKS="16", SLURM_SUBMIT_DIR=str(root),
               PYTHON=sys.executable, PATH=f"{tmp_path}{os.pathsep}{env['PATH']}")
    run = subprocess.run(["bash", str(template), "--data.batch_size", "2"], env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    for expected in ("num_nodes: 2", "devices: '8'", "class_path: lightning.pytorch.strategies.DDPStrategy",
                     "timeout: 0:10:00", "ckpt_path: last", "batch_size: 2", "accelerator: gpu",
                     "hidden_size: 768"):  # --config minimind_pretrain: the packaged preset
        assert expected in run.stdout, expected


@pytest.mark.slow
def test_failing_scontrol_requeue_exits_4_with_the_checkpoint_saved(tmp_path: Path) -> None:
    """``scontrol requeue`` fails (a job that is not requeueable): exit 4 with its reason; the checkpoint
    is committed, and resuming from it works."""
    need_shared()
    env, log = env_with(tmp_path, SLURM)
    scontrol = tmp_path / "bin" / "scontrol"
    scontrol.write_text('#!/bin/sh\necho "$*" >> "$SCONTROL_LOG"\necho "Requested operation not supported on this job" >&2\nexit 1\n')
    args = tiny_args(epochs=2, accumulate=2, save_interval=100)
    stopped = run_signalled(tmp_path, args + ["--ckpt_path", "last"], env, after_lines=3, signum=signal.SIGUSR1)
    assert stopped.returncode == 4, stopped.stderr[-3000:]
    assert f"scontrol requeue {JOB_ID} failed" in stopped.stderr
    assert "Requested operation not supported on this job" in stopped.stderr
    assert log.read_text().splitlines() == [f"requeue {JOB_ID}"]
    last_step = max(stopped.steps)
    one_more = ((last_step[0] - 1) * 12 + last_step[1]) // 2 + 1  # optimizer steps: one after the checkpoint
    resumed = run_cli(tmp_path, args + ["--ckpt_path", "last", "--trainer.max_steps", str(one_more)], env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_resumed(resumed, last_step[0], last_step[1] + 1)
