"""Checkpoint directories on object storage, against a real S3-compatible HTTP server on localhost
(moto's threaded server, as s3fs's own tests use), through s3fs and the network: kill-anywhere resume
on fresh machines from the bucket, the server stopped mid-run, a corrupted remote object, the endpoint
down at the end, secrets on disk, a missing backend."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.helpers.runs import (
    KEY_ID,
    S3,
    SECRET,
    SLURM,
    TINY_JSONL,
    TOKENIZER,
    OnLine,
    Running,
    assert_resumed,
    assert_same_tensors,
    assert_steps_match,
    cli_env,
    final_state,
    free_port,
    need_shared,
    readme_script,
    run_cli,
    tiny_args,
)

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

COMMITTED = "committed to s3://"


@pytest.fixture
def s3() -> Iterator[S3]:
    server = S3(free_port(), f"ckpt-{uuid.uuid4().hex[:12]}")
    server.start()
    import boto3

    boto3.client("s3", endpoint_url=server.endpoint, region_name="us-east-1", aws_access_key_id=KEY_ID,
                 aws_secret_access_key=SECRET).create_bucket(Bucket=server.bucket)
    yield server
    if server.server is not None:
        server.stop()


def remote_args(s3: S3, *extra: str, epochs: int = 2) -> list[str]:
    return tiny_args("--resume.ckpt_dir", s3.url("run", "checkpoints"), "--resume.out_dir", s3.url("run", "out"),
                     *extra, epochs=epochs, accumulate=2, save_interval=5)


def after_commits(k: int) -> OnLine:
    """A :func:`run_cli` hook: SIGKILL the run once ``k`` checkpoints were committed to the bucket."""
    committed = 0

    def hook(line: str, run: Running) -> bool:
        nonlocal committed
        committed += COMMITTED in line
        return committed >= k

    return hook


def remote_position(s3: S3, iters: int = 12) -> tuple[int, int] | None:
    """Where ``--ckpt_path last`` on a fresh machine must resume: after the newest committed remote checkpoint."""
    fs = s3.fs()
    manifests = [json.loads(fs.cat_file(p)) for p in fs.glob(f"{s3.bucket}/run/checkpoints/*.ckpt.manifest.json")]
    if not manifests:
        return None
    newest = max(manifests, key=lambda m: m["saved_at"])
    epoch, step = int(newest["epoch"]), int(newest["step"])
    return (epoch + 2, 1) if step >= iters else (epoch + 1, step + 1)


def assert_no_secret(*roots: Path, texts: tuple[str, ...] = ()) -> None:
    for text in texts:
        assert SECRET not in text
    for root in roots:
        for path in root.rglob("*"):
            if path.is_file():
                assert SECRET.encode() not in path.read_bytes(), f"the secret key is written in {path}"


def test_missing_backend_is_one_line_exit_2(tmp_path: Path) -> None:
    """An s3:// directory without s3fs installed: one ``error:`` line naming the extra, exit 2."""
    need_shared()
    shadow = tmp_path / "no_s3fs"
    (shadow / "s3fs").mkdir(parents=True)
    (shadow / "s3fs" / "__init__.py").write_text("raise ImportError('No module named s3fs')\n")
    env = cli_env()
    env["PYTHONPATH"] = os.pathsep.join([str(shadow), env["PYTHONPATH"]])
    run = run_cli(tmp_path, tiny_args("--resume.ckpt_dir", "s3://bucket/ckpt"), env=env)
    assert run.returncode == 2, run.stderr[-2000:]
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "pip install 'lit-minimind[s3]'" in errors[0] and "--resume.ckpt_dir" in errors[0], run.stderr
    assert "Traceback" not in run.stderr
    assert not (tmp_path / "checkpoints").exists()


def test_last_with_the_endpoint_down_and_no_local_checkpoint_stops_with_one_line(tmp_path: Path) -> None:
    """A fresh machine whose bucket cannot be listed never starts fresh over the bucket's checkpoints."""
    need_shared()
    down = S3(free_port(), "nobucket")  # nothing listens there
    run = run_cli(tmp_path, remote_args(down, "--ckpt_path", "last", epochs=1), env=down.env())
    assert run.returncode == 2, run.stderr[-3000:]
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "cannot list s3://nobucket/run/checkpoints" in errors[0], run.stderr
    assert "no local checkpoint" in errors[0] and not run.steps


@pytest.mark.slow  # make test's budget
def test_endpoint_down_at_the_end_exits_5_then_the_local_checkpoint_wins_and_is_uploaded(tmp_path: Path, s3: S3) -> None:
    """The endpoint down the whole run: training is unaffected (local saves go on), the end waits
    ``--resume.upload_timeout`` and exits 5 with one line saying what the remote holds. Rerun on the same
    machine with the endpoint back: the local checkpoint, newer than the remote's (none), wins and is uploaded."""
    need_shared()
    s3.stop()
    run = run_cli(tmp_path, remote_args(s3, "--resume.upload_timeout", "2", epochs=1), env=s3.env())
    assert run.returncode == 5, run.stderr[-3000:]
    assert len(run.steps) == 12  # every step trained
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "holds no checkpoint" in errors[0] and "epoch 1 step 12" in errors[0], run.stderr
    assert "BEHIND" in run.stdout
    assert (tmp_path / "checkpoints" / "pretrain_64_resume.pth").exists()  # the local staging save is complete

    s3.start()
    again = run_cli(tmp_path, remote_args(s3, "--ckpt_path", "last", epochs=1), env=s3.env())
    assert again.returncode == 0, again.stderr[-3000:]
    assert_resumed(again, 2, 1)  # nothing left to train: the local checkpoint (epoch 1 step 12) is the start
    assert "holds epoch 1 step 12 (global step 6)" in again.stdout and "BEHIND" not in again.stdout
    assert remote_position(s3) == (2, 1)
    assert_no_secret(tmp_path, texts=(run.stdout, run.stderr, again.stdout, again.stderr))


@pytest.mark.slow
def test_killed_runs_resumed_on_fresh_machines_from_the_bucket_are_bit_identical(tmp_path: Path, s3: S3) -> None:
    """SIGKILLed after a committed upload (or at a random console line), each resume on an empty working
    directory: downloaded from the bucket, resumed where the remote stands, ends with the uninterrupted
    run's weights; nothing on disk or on the console carries the secret key."""
    need_shared()
    args = tiny_args(epochs=2, accumulate=2, save_interval=5)
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    ref = run_cli(ref_dir, args)
    assert ref.returncode == 0, ref.stderr[-3000:]

    rng = random.Random("remote-kills")
    runs, dirs = [], []
    for i in range(3):
        run_dir = tmp_path / f"machine{i}"
        run_dir.mkdir()
        dirs.append(run_dir)
        want = remote_position(s3)
        kill_at = rng.randint(1, 2)
        run = run_cli(run_dir, remote_args(s3, "--ckpt_path", "last"), env=s3.env(), on_line=after_commits(kill_at))
        runs.append(run)
        if want is not None:
            assert_resumed(run, *want)
            assert "CRC-32 checked" in run.stdout
        if run.returncode == 0:
            break
        assert run.returncode == -9, run.stderr[-3000:]
    if runs[-1].returncode != 0:
        final_dir = tmp_path / "final"
        final_dir.mkdir()
        dirs.append(final_dir)
        want = remote_position(s3)
        final = run_cli(final_dir, remote_args(s3, "--ckpt_path", "last"), env=s3.env())
        assert final.returncode == 0, final.stderr[-3000:]
        assert want is not None
        assert_resumed(final, *want)
        runs.append(final)
    assert_steps_match(runs, ref)
    ref_weights, ref_resume = final_state(ref_dir, False)
    weights, resume = final_state(dirs[-1], False)
    assert_same_tensors(weights, ref_weights)
    assert_same_tensors(resume["state_dict"], ref_resume["state_dict"])
    # the remote holds the end too: MiniMind's names there (export uploaded, _resume.pth a server-side copy)
    fs = s3.fs()
    remote_weights = torch.load(fs.open(f"{s3.bucket}/run/out/pretrain_64.pth", "rb"), weights_only=True)
    remote_resume = torch.load(fs.open(f"{s3.bucket}/run/checkpoints/pretrain_64_resume.pth", "rb"), weights_only=True)
    assert_same_tensors(remote_weights, ref_weights)
    assert_same_tensors(remote_resume["state_dict"], ref_resume["state_dict"])
    assert "holds epoch 2 step 12" in runs[-1].stdout
    assert_no_secret(tmp_path, texts=tuple(r.stdout + r.stderr for r in runs))


def test_server_stopped_mid_run_loses_no_training_and_the_remote_catches_up(tmp_path: Path, s3: S3) -> None:
    need_shared()
    state = {"stopped": False, "restarted": False}

    def react(line: str, run: Running) -> bool:
        if COMMITTED in line and not state["stopped"]:
            s3.stop()  # after the first committed upload
            state["stopped"] = True
        elif state["stopped"] and not state["restarted"] and "failed" in line and line.startswith("remote:"):
            s3.start()  # the uploader saw the endpoint down: bring it back
            state["restarted"] = True
        return False

    run = run_cli(tmp_path, remote_args(s3, "--resume.upload_timeout", "60"), env=s3.env(), on_line=react)
    assert state["restarted"], run.stdout[-3000:]
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(run.steps) == 24
    assert "answers again" in run.stdout
    assert "holds epoch 2 step 12 (global step 12)" in run.stdout and "BEHIND" not in run.stdout
    local = torch.load(tmp_path / "out" / "pretrain_64.pth", weights_only=True)
    remote = torch.load(s3.fs().open(f"{s3.bucket}/run/out/pretrain_64.pth", "rb"), weights_only=True)
    assert_same_tensors(remote, local)


@pytest.mark.slow
def test_ddp_run_killed_then_resumed_on_a_fresh_machine_from_the_bucket_is_bit_identical(tmp_path: Path, s3: S3) -> None:
    """2 processes (the spot recipe's torchrun shape): global rank 0 uploads; SIGKILLed (the whole group)
    after the first committed upload, resumed on 2 processes in an empty directory from the bucket: each
    rank loads rank 0's download and the run ends with the uninterrupted 2-process run's weights."""
    need_shared()
    ddp = tiny_args(epochs=1, accumulate=2, save_interval=3, devices=2)
    ref_dir, first, fresh = tmp_path / "ref", tmp_path / "first", tmp_path / "fresh"
    for d in (ref_dir, first, fresh):
        d.mkdir()
    ref = run_cli(ref_dir, ddp)
    assert ref.returncode == 0, ref.stderr[-3000:]
    remote = [*ddp, "--resume.ckpt_dir", s3.url("run", "checkpoints"), "--resume.out_dir", s3.url("run", "out"),
              "--ckpt_path", "last"]
    killed = run_cli(first, remote, env=s3.env(), on_line=after_commits(1))
    assert killed.returncode == -9, killed.stderr[-3000:]
    want = remote_position(s3, iters=6)
    assert want is not None
    resumed = run_cli(fresh, remote, env=s3.env())
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_resumed(resumed, *want)
    assert "CRC-32 checked" in resumed.stdout
    assert_steps_match([killed, resumed], ref)
    ref_weights, ref_resume = final_state(ref_dir, False)
    weights, resume = final_state(fresh, False)
    assert_same_tensors(weights, ref_weights)
    assert_same_tensors(resume["state_dict"], ref_resume["state_dict"])
    assert "holds epoch 1 step 6" in resumed.stdout


@pytest.mark.slow
def test_own_script_with_a_bucket_killed_then_resumed_on_a_fresh_machine_is_bit_identical(tmp_path: Path, s3: S3) -> None:
    """The README's own-script block with ``ResumeCallback(ckpt_dir="s3://...", out_dir="s3://...")``: SIGKILLed
    after the first committed upload, rerun in an empty directory: ``ckpt_path="last"`` downloads the
    bucket's newest checkpoint and the run ends with the uninterrupted run's weights, the bucket's too."""
    need_shared()
    data = [str(TINY_JSONL), str(TOKENIZER)]
    dirs = {name: tmp_path / name for name in ("ref", "first", "fresh")}
    bucket = ("ResumeCallback(save_interval=5)", f"ResumeCallback(save_interval=5, ckpt_dir={s3.url('run', 'checkpoints')!r}, "
              f"out_dir={s3.url('run', 'out')!r})")
    for name, d in dirs.items():
        d.mkdir()
        (d / "train.py").write_text(readme_script(None if name == "ref" else bucket))
    script = [sys.executable, "train.py"]
    ref = run_cli(dirs["ref"], data, command=script)
    assert ref.returncode == 0, ref.stderr[-3000:]
    killed = run_cli(dirs["first"], data, env=s3.env(), on_line=after_commits(1), command=script)
    assert killed.returncode == -9, killed.stderr[-3000:]
    want = remote_position(s3)
    assert want is not None
    resumed = run_cli(dirs["fresh"], data, env=s3.env(), command=script)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_resumed(resumed, *want)
    assert_steps_match([killed, resumed], ref)
    ref_weights, ref_resume = final_state(dirs["ref"], False)
    weights, resume = final_state(dirs["fresh"], False)
    assert_same_tensors(weights, ref_weights)
    assert_same_tensors(resume["state_dict"], ref_resume["state_dict"])
    remote_weights = torch.load(s3.fs().open(f"{s3.bucket}/run/out/pretrain_64.pth", "rb"), weights_only=True)
    assert_same_tensors(remote_weights, ref_weights)  # the end of the run waited for its upload


@pytest.mark.slow
def test_a_corrupted_remote_checkpoint_is_skipped_for_the_previous_one(tmp_path: Path, s3: S3) -> None:
    need_shared()
    first = tmp_path / "first"
    first.mkdir()
    run = run_cli(first, remote_args(s3, epochs=1), env=s3.env())
    assert run.returncode == 0, run.stderr[-3000:]
    # two more optimizer steps (4 batches of epoch 2): the end of a run is always uploaded, so the remote
    # holds at least the epoch 1 end and this one, whichever intermediate saves a newer one replaced
    more = run_cli(first, remote_args(s3, "--ckpt_path", "last", "--trainer.max_steps", "8"), env=s3.env())
    assert more.returncode == 0, more.stderr[-3000:]
    fs = s3.fs()
    committed = sorted((json.loads(fs.cat_file(p)) for p in fs.glob(f"{s3.bucket}/run/checkpoints/*.ckpt.manifest.json")),
                       key=lambda m: m["saved_at"], reverse=True)
    assert len(committed) == 2, committed  # keep_last 2 on the remote too
    newest, previous = committed
    assert newest["global_step"] > 6 > previous["global_step"] - 1  # run 2's end; before it: epoch 1's
    path = f"{s3.bucket}/run/checkpoints/{newest['file']}"
    data = bytearray(fs.cat_file(path))
    data[len(data) // 2] ^= 0xFF  # same size, one byte changed after the commit
    fs.pipe_file(path, bytes(data))

    fresh = tmp_path / "fresh"
    fresh.mkdir()
    resumed = run_cli(fresh, remote_args(s3, "--ckpt_path", "last"), env=s3.env())
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "skipping remote checkpoint" in resumed.stderr and newest["file"] in resumed.stderr
    epoch, step = int(previous["epoch"]), int(previous["step"])
    assert_resumed(resumed, *((epoch + 2, 1) if step >= 12 else (epoch + 1, step + 1)))
    assert not list((fresh / "checkpoints").glob("*.tmp"))  # nothing of the damaged download stays


def test_the_sbatch_template_takes_the_bucket_from_ckpt_url(tmp_path: Path) -> None:
    """``CKPT_URL=s3://... sbatch scripts/slurm_pretrain.sbatch``: the remote directories reach the CLI
    (a fake ``srun`` prints the resolved config)."""
    root = Path(__file__).resolve().parents[1]
    srun = tmp_path / "srun"
    srun.write_text('#!/bin/sh\nwhile [ "${1#-}" != "$1" ]; do shift; done\nexec "$@" --print_config\n')
    srun.chmod(0o755)
    env = {k: v for k, v in cli_env().items() if not k.startswith("SLURM_")}
    env.update(SLURM, SLURM_NNODES="1", SLURM_NTASKS_PER_NODE="1", SLURM_NTASKS="1", SLURM_SUBMIT_DIR=str(root),
               PYTHON=sys.executable, PATH=f"{tmp_path}{os.pathsep}{env['PATH']}", CKPT_URL="s3://my-bucket/run1/")
    run = subprocess.run(["bash", str(root / "scripts" / "slurm_pretrain.sbatch")], env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "ckpt_dir: s3://my-bucket/run1/checkpoints" in run.stdout and "out_dir: s3://my-bucket/run1/out" in run.stdout
