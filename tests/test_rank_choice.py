"""One ``--ckpt_path last`` for all ranks: global rank 0 resolves it (reading the file whole, CRC) and
every rank loads rank 0's choice, even a rank whose directory listing shows another newest file."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lit_minimind.checkpoint.atomic import atomic_save
from lit_minimind.resume.start import choose_checkpoint
from tests.helpers.runs import LINE_RE, cli_env, need_shared, run_cli, tiny_args

SLURM = {"SLURM_JOB_ID": "77", "SLURM_JOB_NAME": "train", "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2",
         "SLURM_NNODES": "1", "SLURM_NODEID": "0", "SLURM_NODELIST": "localhost", "MASTER_ADDR": "127.0.0.1"}


def test_only_rank_0_reads_the_checkpoint_it_chooses(tmp_path: Path) -> None:
    """Rank 0 skips a damaged newest file (it reads it: CRC); another rank takes the newest unread."""
    older, newer = tmp_path / "pretrain_64_e0_s2_g1_a.ckpt", tmp_path / "pretrain_64_e0_s4_g2_a.ckpt"
    atomic_save({"x": torch.zeros(64)}, older, {"kind": "lightning"})
    atomic_save({"x": torch.ones(64)}, newer, {"kind": "lightning"})
    data = bytearray(newer.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newer.write_bytes(bytes(data))  # damaged after its manifest was written
    assert choose_checkpoint("last", tmp_path, "pretrain_64", global_rank=0) == str(older)
    assert choose_checkpoint("last", tmp_path, "pretrain_64", global_rank=1) == str(newer)
    assert choose_checkpoint(None, tmp_path, "pretrain_64", global_rank=0) is None


def copy_checkpoint(ref_dir: Path, epoch: int, step: int, to: Path) -> None:
    (to / "checkpoints").mkdir(parents=True, exist_ok=True)
    (ckpt,) = (ref_dir / "checkpoints").glob(f"pretrain_64_e{epoch}_s{step}_g*.ckpt")
    for f in ckpt.parent.glob(f"{ckpt.name}*"):  # the checkpoint and its manifest
        shutil.copy2(f, to / "checkpoints" / f.name)


@pytest.mark.slow
def test_a_rank_that_sees_another_newest_file_loads_rank_0s_choice(tmp_path: Path) -> None:
    """Two SLURM tasks (DDP on gloo), each in its own working directory: rank 0's ``checkpoints/``
    holds epoch 1 step 4, rank 1's also a newer epoch 2 step 4. Both load rank 0's file; the resumed
    run ends exactly as the uninterrupted one."""
    need_shared()
    config = tiny_args(epochs=2, accumulate=2, save_interval=4, devices=2)
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    ref = run_cli(ref_dir, config + ["--resume.keep_last", "100"])
    assert ref.returncode == 0, ref.stderr[-3000:]
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    copy_checkpoint(ref_dir, 0, 4, node0)
    copy_checkpoint(ref_dir, 0, 4, node1)
    copy_checkpoint(ref_dir, 1, 4, node1)  # only rank 1 sees it

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs, logs = [], []
    for rank, cwd in enumerate((node0, node1)):
        env = {k: v for k, v in cli_env().items() if not k.startswith("SLURM_")}
        env.update(SLURM, SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), MASTER_PORT=str(port))
        logs.append((open(cwd / "task.out", "w+"), open(cwd / "task.err", "w+")))
        procs.append(subprocess.Popen([sys.executable, "-m", "lit_minimind.fit", *config, "--ckpt_path", "last"],
                                      cwd=cwd, env=env, text=True, stdout=logs[-1][0], stderr=logs[-1][1],
                                      start_new_session=True))
    try:
        deadline = time.monotonic() + 240
        codes = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
    out = [(o.seek(0), o.read(), e.seek(0), e.read()) for o, e in logs]
    assert codes == [0, 0], out[0][3][-3000:] + out[1][3][-3000:]
    (line,) = [ln for ln in out[1][3].splitlines() if "--ckpt_path: this rank saw" in ln]
    assert line.startswith("[rank 1]") and "_e1_s4_" in line and f"choice {node0 / 'checkpoints'}" in line
    assert "_e0_s4_" in line.split("choice")[1]
    assert "this rank saw" not in out[0][3]
    steps = {(int(m[0]), int(m[2])): (m[4], m[5], m[6], m[7]) for m in LINE_RE.findall(out[0][1])}
    assert min(steps) == (1, 5) and max(steps) == (2, 6)
    for key, values in steps.items():
        assert values == ref.steps[key], f"step {key} differs"
    ref_w = torch.load(ref_dir / "out" / "pretrain_64.pth", weights_only=True)
    got_w = torch.load(node0 / "out" / "pretrain_64.pth", weights_only=True)
    assert all(torch.equal(ref_w[k], got_w[k]) for k in ref_w)
