"""Several machines, simulated on localhost with torchrun (gloo on CPU): two "nodes" of one process.

A 2-node x 1-process run ends bit-identical to a 1-node x 2-process run; killing both nodes and
resuming (on 2 nodes, or on 1 process) is exact; a node that dies or hangs makes the survivor exit 3
with one line of advice, within the process-group timeout; torchrun's ``--max-restarts`` restarts a
killed worker, which resumes from ``--ckpt_path last`` exactly.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from lit_minimind.resume.start import resolve_last
from tests.helpers.runs import (
    LINE_RE,
    assert_resumed,
    assert_same_weights,
    expected_resume,
    kill_tree,
    need_shared,
    resumed_at,
    run_cli,
    tiny_args,
    torchrun,
    workers,
)

ADVICE = "Restart every node with the same command plus --ckpt_path last"
TIMEOUT = ["--trainer.strategy", "lightning.pytorch.strategies.DDPStrategy", "--trainer.strategy.timeout", "0:00:10"]
# a dead peer is seen from its closed connection, long before this timeout would expire
LONG_TIMEOUT = ["--trainer.strategy", "lightning.pytorch.strategies.DDPStrategy", "--trainer.strategy.timeout", "0:02:00"]


def next_batch(saved: dict, iters: int, world_size: int = 2, saved_world_size: int = 2) -> tuple[int, int]:
    """The 1-based (epoch, step) after a checkpoint's MiniMind position, on ``world_size`` processes."""
    epoch, step = int(saved["epoch"]), int(saved["step"]) * saved_world_size // world_size
    return (epoch + 2, 1) if step >= iters else (epoch + 1, step + 1)


def config(*extra: str) -> list[str]:
    """The 2-process config of tests/test_ddp.py (2 epochs of 6 batches per rank, saves at 5 and 6)."""
    return tiny_args(*extra, epochs=2, accumulate=2, save_interval=5, devices=2)


def node_args(*extra: str) -> list[str]:
    """``config`` as each node's flags: 2 nodes x 1 device."""
    args = config(*extra)
    args[args.index("--trainer.devices") + 1] = "1"
    return [*args, "--trainer.num_nodes", "2"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """The uninterrupted 1-node x 2-process run (``python -m``, Lightning's own launcher), every
    checkpoint kept."""
    need_shared()
    ref_dir = tmp_path_factory.mktemp("ref_1x2")
    ref = run_cli(ref_dir, config("--resume.keep_last", "100"))
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert len(ref.steps) == 12
    return ref_dir, ref.steps


@pytest.mark.slow  # four 2-node runs: under a minute (make test-slow)
def test_two_nodes_equal_one_node_and_resume_exactly_after_both_die(tmp_path: Path, reference: tuple[Path, dict]) -> None:
    ref_dir, ref_steps = reference

    # uninterrupted, 2 nodes x 1 process: the same steps and bit-identical weights as 1 node x 2
    two_dir = tmp_path / "two"
    two_dir.mkdir()
    two = torchrun(two_dir, node_args())
    assert two.returncodes == [0, 0], two.stderr[0][-3000:] + two.stderr[1][-3000:]
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in two.stderr[1]  # TorchElasticEnvironment
    assert two.steps == ref_steps
    assert not LINE_RE.search(two.rank1_stdout) and "summary" not in two.rank1_stdout  # rank 0 prints
    assert_same_weights(ref_dir, two_dir)

    # both nodes SIGKILLed in epoch 2 (after the saves at epoch 1 step 5 and its end), then resumed on 2 nodes
    killed_dir = tmp_path / "killed"
    killed_dir.mkdir()
    killed = torchrun(killed_dir, node_args("--ckpt_path", "last"), after_lines=9,
                      action=lambda launchers: [kill_tree(l) for l in launchers])
    assert killed.returncodes == [-9, -9]
    last = resolve_last(killed_dir / "checkpoints", "pretrain_64")
    assert last is not None, "no checkpoint committed before the kill"
    saved = torch.load(last, weights_only=True)  # MiniMind's keys: epoch (0-based), step (per rank)
    one_dir = tmp_path / "one"
    shutil.copytree(killed_dir, one_dir)  # the same files, for the 1-process resume below

    resumed = torchrun(killed_dir, node_args("--ckpt_path", "last"))
    assert resumed.returncodes == [0, 0], resumed.stderr[0][-3000:]
    assert_resumed(resumed.stderr[0], *next_batch(saved, iters=6), lines=resumed.steps)
    assert resumed.steps and min(resumed.steps) > (1, 4)
    for key, values in {**killed.steps, **resumed.steps}.items():
        assert values == ref_steps[key], f"step {key} differs after the 2-node resume"
    assert_same_weights(ref_dir, killed_dir)

    # the 2-node checkpoint resumed on 1 node x 1 process (world-size correction) ends exactly as
    # the 1-node x 2-process checkpoint of the same step does
    single = tiny_args("--ckpt_path", "last", epochs=2, accumulate=2, save_interval=5, devices=1)
    got = run_cli(one_dir, single)
    assert got.returncode == 0, got.stderr[-3000:]
    assert "world size changed (2→1)" in got.stderr
    assert_resumed(got, *next_batch(saved, iters=12, world_size=1))
    from_ref = tmp_path / "from_ref"
    (from_ref / "checkpoints").mkdir(parents=True)
    (ref_ckpt,) = (ref_dir / "checkpoints").glob(f"pretrain_64_e{saved['epoch']}_s{saved['step']}_g*.ckpt")
    for f in ref_dir.joinpath("checkpoints").glob(f"{ref_ckpt.name}*"):  # the checkpoint and its manifest
        shutil.copy(f, from_ref / "checkpoints" / f.name)
    want = run_cli(from_ref, single)
    assert want.returncode == 0, want.stderr[-3000:]
    assert_resumed(want, *next_batch(saved, iters=12, world_size=1))
    assert got.steps == want.steps and got.steps
    assert_same_weights(from_ref, one_dir)


@pytest.mark.slow  # half a minute (make test-slow; keeps make test under its budget)
def test_a_dead_node_stops_the_survivor_at_once_and_the_resume_is_exact(tmp_path: Path,
                                                                        reference: tuple[Path, dict]) -> None:
    """Node 1's worker SIGKILLed mid-training: gloo sees the closed connection; node 0 exits 3 at once."""
    ref_dir, ref_steps = reference
    args = node_args(*LONG_TIMEOUT, "--ckpt_path", "last")
    died = torchrun(tmp_path, args, after_lines=8, action=lambda launchers: [w.kill() for w in workers(launchers[1])])
    assert died.returncodes[0] not in (0, None) and died.returncodes[1] not in (0, None)
    assert ADVICE in died.stderr[0] and "exitcode  : 3" in died.stderr[0]
    assert "[rank0]: Traceback" not in died.stderr[0]  # one line, no traceback
    # no wait for the timeout (120 s): seconds on an idle machine, well under 40 s on a loaded one
    assert died.node0_exit_s is not None and died.node0_exit_s < 40, died.node0_exit_s
    print(f"node 0 exited {died.node0_exit_s:.1f} s after node 1 died")

    want = expected_resume(tmp_path, iters=6)
    assert want is not None, "no checkpoint committed before node 1 died"
    resumed = torchrun(tmp_path, args)
    assert resumed.returncodes == [0, 0], resumed.stderr[0][-3000:]
    assert_resumed(resumed.stderr[0], *want, lines=resumed.steps)
    for key, values in {**died.steps, **resumed.steps}.items():
        assert values == ref_steps[key], f"step {key} differs after the resume"
    assert_same_weights(ref_dir, tmp_path)


@pytest.mark.slow  # half a minute (make test-slow; keeps make test under its budget)
def test_a_hung_node_stops_the_survivor_after_the_timeout(tmp_path: Path, reference: tuple[Path, dict]) -> None:
    """Node 1's worker SIGSTOPped (a hung machine, a network partition: no connection error): node 0
    exits 3 once the process group's timeout (10 s here) expires, instead of waiting forever."""
    died = torchrun(tmp_path, node_args(*TIMEOUT, "--ckpt_path", "last"), after_lines=8,
                    action=lambda launchers: [w.suspend() for w in workers(launchers[1])], reap=True)
    assert died.returncodes[0] not in (0, None)
    (advice,) = [line for line in died.stderr[0].splitlines() if ADVICE in line]
    assert "timed out" in advice.lower() or "timeout" in advice.lower(), advice  # gloo words it two ways
    assert "exitcode  : 3" in died.stderr[0]
    # the timeout, not before it (the blocked collective may have begun just before the stop), and not
    # much after it: a loaded 2-core machine tears down within seconds; 60 s is far more
    assert died.node0_exit_s is not None and 8 <= died.node0_exit_s < 60, died.node0_exit_s
    print(f"node 0 exited {died.node0_exit_s:.1f} s after node 1 hung (timeout 10 s)")


@pytest.mark.slow  # make test-slow (test_watchdog restarts a job under torchrun too)
def test_torchrun_restarts_a_killed_worker_which_resumes_exactly(tmp_path: Path, reference: tuple[Path, dict]) -> None:
    """1 node x 2 processes, ``--standalone --max-restarts 1``: rank 1's worker SIGKILLed once; torchrun
    restarts the group with the same command line (``--ckpt_path last``), which resumes from the last save."""
    ref_dir, ref_steps = reference

    def kill_rank1(launchers: list[subprocess.Popen]) -> None:
        (rank1,) = [w for w in workers(launchers[0]) if w.environ().get("RANK") == "1"]
        rank1.send_signal(signal.SIGKILL)

    run = torchrun(tmp_path, config("--ckpt_path", "last"), nnodes=1, nproc=2, max_restarts=1,
                   after_lines=9, action=kill_rank1)
    assert run.returncodes == [0], run.stderr[0][-3000:]
    assert ADVICE in run.stderr[0]  # rank 0 of the first attempt
    assert resumed_at(run.stderr[0]) is not None, "the restarted group did not resume"
    # the console lines of both attempts: the restarted one repeats the steps since the last save
    assert len(run.lines) > 12
    for m in run.lines:
        key = (int(m[0]), int(m[2]))
        assert (m[4], m[5], m[6], m[7]) == ref_steps[key], f"step {key} differs"
    assert_same_weights(ref_dir, tmp_path)


def test_lost_peer_advice_only_for_distributed_failures(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before the process group exists (a node never came): torch's DistError types only."""
    import torch.distributed as dist

    from lit_minimind.callbacks.preemption import lost_peer_advice

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    advice = lost_peer_advice(dist.DistStoreError("Timed out after 601 seconds waiting for clients. 1/2 clients joined."))
    assert advice is not None and advice.startswith("[rank 1] error: lost contact") and ADVICE in advice
    assert "(Timed out after 601 seconds waiting for clients)" in advice
    assert lost_peer_advice(RuntimeError("Connection reset by peer")) is None  # no process group: not ours to judge
    assert lost_peer_advice(ValueError("timeout")) is None
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert lost_peer_advice(dist.DistStoreError("x")) is None
