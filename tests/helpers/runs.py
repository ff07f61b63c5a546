"""What the tests share: the paths to ``../shared``, MiniMind's tiny config as CLI flags, running the real
CLI in a subprocess (one runner, :func:`run_cli`, with a per-line hook), where a run resumed, comparing
runs, and the fakes several test files use (SLURM, torchrun on localhost, an S3 server).

Every test imports it the same way: ``from tests.helpers.runs import ...`` (``pythonpath = ["."]`` in
pyproject.toml puts the repository root on ``sys.path``). Test-only: the CLI under test never imports it.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from tests.helpers import zygote
from tests.helpers.faults import SAVE_FILES

# ----------------------------------------------------------------------------- paths and the tiny config

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT.parent / "shared"
MINIMIND = SHARED / "minimind"
TINY_JSONL = MINIMIND / "original_run" / "tiny.jsonl"
TOKENIZER = MINIMIND / "tokenizer"
MUTANTS = ROOT / "tests" / "mutants"  # scripts/mutants.py: deliberate breaks, chosen by LIT_MINIMIND_MUTANT
SHARED_ABSENT = "../shared is absent"  # in the skip reason: conftest's terminal summary counts these skips

LINE_RE = re.compile(
    # MiniMind's line; its DPO line (train_dpo.py) says dpo_loss and learning_rate (the reward model's: reward_loss); its distillation line
    # (train_distillation.py) ce, and distill after aux_loss (the 5th value: DISTILL_RE); its GRPO line (train_grpo.py):
    # groups 9-15 (reward, KL_ref, advantages' std and mean, actor loss, response length, lr), groups 4-8 empty
    r"Epoch:\[(\d+)/(\d+)\]\((\d+)/(\d+)\), (?:loss: ([\d.]+), (?:logits_loss|dpo_loss|reward_loss|ce): ([\d.]+), "
    r"aux_loss: ([\d.]+), (?:distill: [\d.]+, )?(?:lr|learning_rate): ([\d.]+), epoch_time: ([\d.]+)min"
    r"|Reward: (-?[\d.]+), KL_ref: (-?[\d.]+), Adv Std: (-?[\d.]+), Adv Mean: (-?[\d.]+), Actor Loss: (-?[\d.]+), "
    r"Avg Response Len: ([\d.]+), Learning Rate: ([\d.]+)"
    # its PPO line (train_ppo.py): groups 16-23 (reward, KL_ref, approx KL, clipfrac, critic loss, length, actor and critic lr)
    r"|Reward: (-?[\d.]+), KL_ref: (-?[\d.]+), Approx KL: (-?[\d.]+), ClipFrac: ([\d.]+), Critic Loss: ([\d.]+), "
    r"Avg Response Len: ([\d.]+), Actor LR: ([\d.]+), Critic LR: ([\d.]+)"
    # its agent RL line (train_agent.py): groups 24-31 (reward, KL, group std, advantages' std, loss, length, adv mean, lr)
    r"|Reward:(-?[\d.]+), KL:(-?[\d.]+), GrpStd:(-?[\d.]+), AdvStd:(-?[\d.]+), Loss:(-?[\d.]+), AvgLen:([\d.]+), "
    r"AdvMean:(-?[\d.]+), LR:([\d.]+))"
)
DISTILL_RE = re.compile(r"Epoch:\[(\d+)/\d+\]\((\d+)/\d+\), loss: ([\d.]+), ce: ([\d.]+), aux_loss: ([\d.]+), "
                        r"distill: ([\d.]+), learning_rate: ([\d.]+)")


def need_shared() -> None:
    if not MINIMIND.exists():
        pytest.skip(f"reference data not found at {MINIMIND} ({SHARED_ABSENT})")


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


def readme_script(*edits: tuple[str, str] | None) -> str:
    """The python block of the docs' page "In your own Lightning script" (docs/own-script.md), with ``edits``
    (old, new)."""
    page = (ROOT / "docs" / "own-script.md").read_text()
    text = re.search(r"```python\n(.*?)```", page, re.S).group(1)
    for old, new in filter(None, edits):
        assert old in text, f"the docs' script no longer has {old!r}"
        text = text.replace(old, new)
    return text


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- running the CLI


def steps_of(lines: list[tuple]) -> dict[tuple[int, int], tuple[str, ...]]:
    """(epoch, step) -> printed (loss, logits_loss, aux_loss, lr) of ``LINE_RE.findall`` matches (a GRPO line:
    its seven values)."""
    return {(int(m[0]), int(m[2])): (m[4], m[5], m[6], m[7]) if m[4] else tuple(m[9:16]) if m[9] else tuple(m[16:24]) if m[16]
            else tuple(m[24:32]) for m in lines}


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    lines: list[tuple] = field(default_factory=list)
    timed_out: bool = False  # run_cli's ``limit`` passed: the run was SIGKILLed for it

    @property
    def steps(self) -> dict[tuple[int, int], tuple[str, ...]]:
        """(epoch, step) -> printed (loss, logits_loss, aux_loss, lr)."""
        return steps_of(self.lines)


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


def kill_session(pid: int, signum: int = signal.SIGKILL) -> None:
    """``signum`` to the process group of ``pid`` (a run started in a session of its own), if any is left."""
    try:
        os.killpg(pid, signum)
    except ProcessLookupError:
        pass


class Running:
    """A run in progress, as a per-line hook of :func:`run_cli` / :func:`follow` sees it."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.console_lines = 0  # MiniMind console lines (LINE_RE) read so far, the current one included

    def send(self, signum: int, *, group: bool = False) -> None:
        """``signum`` to the run's first process (the launcher, rank 0), or to its whole process group."""
        (os.killpg if group else os.kill)(self.proc.pid, signum)


# called with each stdout line as it is read; True: stop reading (run_cli then SIGKILLs the run)
OnLine = Callable[[str, Running], "bool | None"]


def once(when: Callable[[str, Running], bool], act: Callable[[Running], object]) -> OnLine:
    """A hook that calls ``act(run)`` the first time ``when(line, run)`` holds, and never stops the run."""
    done = False

    def hook(line: str, run: Running) -> bool:
        nonlocal done
        if not done and when(line, run):
            done = True
            act(run)
        return False

    return hook


def at_line(n: int, act: Callable[[Running], object]) -> OnLine:
    """``act(run)`` once, right after the ``n``-th MiniMind console line was read."""
    return once(lambda line, run: run.console_lines >= n, act)


def at_text(text: str, act: Callable[[Running], object]) -> OnLine:
    """``act(run)`` once, right after the first stdout line containing ``text`` was read."""
    return once(lambda line, run: text in line, act)


def follow(proc: subprocess.Popen, on_line: OnLine | None = None) -> tuple[list[str], Running, bool]:
    """Read ``proc``'s stdout line by line as it comes, calling ``on_line(line, running)`` after each,
    until the output ends or ``on_line`` returns True. Returns the lines read, the :class:`Running`
    the hook saw, and whether the hook stopped the reading."""
    running, out = Running(proc), []
    assert proc.stdout is not None
    for line in proc.stdout:
        out.append(line)
        running.console_lines += bool(LINE_RE.search(line))
        if on_line is not None and on_line(line, running):
            return out, running, True
    return out, running, False


def run_cli(cwd: Path, args: list[str], *, on_line: OnLine | None = None, kill_after_lines: int | None = None,
            env: dict[str, str] | None = None, timeout: float = 300, limit: float | None = None,
            kill_group: bool = True, command: list[str] | None = None) -> Run:
    """Run ``python -m lit_minimind.fit`` (or ``command``, e.g. ``[python, script.py]``) in ``cwd``, in a
    session of its own, and return its exit code and output.

    ``on_line(line, running)`` is called with each stdout line as it is read (it may send a signal,
    record something, or return True: SIGKILL the run there). ``kill_after_lines=k`` SIGKILLs right
    after the k-th MiniMind console line; a process that stops itself inside a save (test hook,
    ``@@stopped-in-save`` / ``@@stopped-after-save``) is SIGKILLed there. ``kill_group``: those kills
    take every process of the run (DDP ranks, wandb's service), else only the first process.
    ``timeout``: how long to wait for the rest once the output ended or the kill was sent, before the
    whole group is SIGKILLed; ``limit``: seconds after which a run still going is SIGKILLed and
    :attr:`Run.timed_out` set (a hang fails the test instead of blocking it).
    """
    # own session: a kill takes the whole process group (DDP ranks included), as a preemption does; the CLI
    # itself is forked from a Python that already imported it (tests/helpers/zygote.py), else launched
    env = env or cli_env()
    proc = zygote.start(args, cwd, env) if command is None else None
    if proc is None:
        proc = subprocess.Popen([*(command or [sys.executable, "-m", "lit_minimind.fit"]), *args], cwd=cwd,
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
    err: list[str] = []
    err_reader = threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True)  # stderr never fills up
    err_reader.start()
    timed_out = threading.Event()
    timer = threading.Timer(limit, lambda: (timed_out.set(), kill_session(proc.pid))) if limit is not None else None
    if timer is not None:
        timer.start()

    def stop_here(line: str, running: Running) -> bool:
        stop = bool(on_line is not None and on_line(line, running))
        # "in", not "starts with": the writer thread's @@ line can land inside a console line the main
        # thread is printing at that moment (print writes text and newline separately)
        stop = stop or "@@stopped-in-save" in line or "@@stopped-after-save" in line
        return stop or (kill_after_lines is not None and running.console_lines >= kill_after_lines)

    try:
        out, _, stopped = follow(proc, stop_here)
        if stopped:
            if kill_group:
                kill_session(proc.pid)
            elif proc.poll() is None:
                proc.kill()
        # the rest: what came after the kill, and stderr; a process left holding the pipes (wandb's
        # service after a kill of the trainer alone) gets ``timeout`` seconds, then the whole group goes
        rest_reader = threading.Thread(target=lambda: out.append(proc.stdout.read()), daemon=True)
        rest_reader.start()
        deadline = time.monotonic() + timeout
        for reader in (rest_reader, err_reader):
            reader.join(max(0.0, deadline - time.monotonic()))
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        if proc.poll() is None or rest_reader.is_alive() or err_reader.is_alive():
            kill_session(proc.pid)
            proc.wait()
            rest_reader.join(30), err_reader.join(30)
    except BaseException:  # a hook's failed assertion, Ctrl-C: no run is left behind
        kill_session(proc.pid)
        proc.wait()
        raise
    finally:
        if timer is not None:
            timer.cancel()
    stdout = "".join(out)
    return Run(proc.returncode, stdout, "".join(err), LINE_RE.findall(stdout), timed_out.is_set())


# ----------------------------------------------------------------------------- where a run resumed

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

    from lit_minimind.resume.start import resolve_last

    last = resolve_last(run_dir / "checkpoints", stem)
    if last is None:
        return None
    saved = torch.load(last, weights_only=True, map_location="cpu")
    epoch, step = int(saved["epoch"]), int(saved["step"])
    return (epoch + 2, 1) if step >= iters else (epoch + 1, step + 1)


# ----------------------------------------------------------------------------- comparing runs


def final_state(run_dir: Path, moe: bool) -> tuple[dict, dict]:
    """The exported weights and the ``_resume.pth`` of a finished run (MiniMind's pretraining names)."""
    import torch

    stem = f"pretrain_64{'_moe' if moe else ''}"
    weights = torch.load(run_dir / "out" / f"{stem}.pth", weights_only=True)
    resume = torch.load(run_dir / "checkpoints" / f"{stem}_resume.pth", weights_only=True)
    return weights, resume


def assert_same_tensors(a: dict, b: dict) -> None:
    import torch

    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"tensor {k} differs"


def assert_same_weights(a: Path, b: Path, name: str = "pretrain_64.pth") -> None:
    """Two runs' exports ``out/<name>`` hold the same tensors, bit for bit."""
    import torch

    assert_same_tensors(*(torch.load(d / "out" / name, weights_only=True) for d in (a, b)))


def assert_steps_match(runs: list[Run], ref: Run) -> None:
    """Every step the interrupted runs printed equals the uninterrupted run's, and together they trained all."""
    seen: dict = {}
    for run in runs:
        for key, values in run.steps.items():
            assert values == ref.steps[key], f"step {key}: {values} != uninterrupted {ref.steps[key]}"
            seen[key] = values
    assert seen.keys() == ref.steps.keys(), "some steps were never trained"


def assert_same_files(ref_dir: Path, run_dir: Path, names: list[str]) -> None:
    """The files ``names`` hold the same tensors in both runs (a Lightning checkpoint: its ``state_dict``)."""
    import torch

    for name in names:
        ref_state, state = (torch.load(d / name, weights_only=True) for d in (ref_dir, run_dir))
        if "state_dict" in ref_state:
            ref_state, state = ref_state["state_dict"], state["state_dict"]
        assert_same_tensors(state, ref_state)


def run_resuming(run_dir: Path, args: list[str], stem: str, iters: int = 12, **kwargs) -> Run:
    """``args + --ckpt_path last``, asserting it resumed where the checkpoint ``last`` names (or, with
    none on disk, that it started fresh)."""
    want = expected_resume(run_dir, stem, iters)
    run = run_cli(run_dir, args + ["--ckpt_path", "last"], **kwargs)
    if want is None:
        assert resumed_at(run) is None, run.stderr[-2000:]
    elif run.returncode != -9 or resumed_at(run) is not None:  # a kill may come before the resume line
        assert_resumed(run, *want)
    return run


def run_until_done(run_dir: Path, args: list[str], rng: random.Random, kills: int, total_lines: int,
                   stem: str = "pretrain_64", iters: int = 12) -> list:
    """SIGKILL ``kills`` times (after a random console line, or inside a random save), then finish;
    every process after a save resumes where its checkpoint says."""
    runs = []
    for _ in range(kills):
        if rng.random() < 0.5:
            run = run_resuming(run_dir, args, stem, iters, kill_after_lines=rng.randint(1, total_lines - 1))
        else:
            env = cli_env(LIT_MINIMIND_TEST_STOP_IN_SAVE=f"{rng.randint(1, 2)}:{rng.choice(SAVE_FILES)}")
            run = run_resuming(run_dir, args, stem, iters, env=env)
        runs.append(run)
        if run.returncode == 0:  # finished before the planned kill point
            return runs
        assert run.returncode == -9, run.stderr[-3000:]
    final = run_resuming(run_dir, args, stem, iters)
    assert final.returncode == 0, final.stderr[-3000:]
    runs.append(final)
    assert any(resumed_at(r) for r in runs), "no process resumed: nothing was tested"
    return runs


# ----------------------------------------------------------------------------- the processes of a run


def rank_pid(launcher: subprocess.Popen, rank: int) -> int:
    """The pid of DDP rank ``rank`` > 0: the child Lightning's launcher started with ``LOCAL_RANK`` set."""
    for child in psutil.Process(launcher.pid).children(recursive=True):
        try:
            if child.environ().get("LOCAL_RANK") == str(rank):
                return child.pid
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    raise AssertionError(f"no process of rank {rank} under {launcher.pid}")


def dataloader_workers(pid: int) -> list[psutil.Process]:
    """The DataLoader worker processes under ``pid`` (torch names their thread ``pt_data_worker``)."""
    found = []
    for child in psutil.Process(pid).children(recursive=True):
        try:
            if "pt_data_worker" in Path(f"/proc/{child.pid}/comm").read_text():
                found.append(child)
        except OSError:
            pass
    return found


# ----------------------------------------------------------------------------- a fake SLURM

JOB_ID = "4242"
SLURM = {"SLURM_JOB_ID": JOB_ID, "SLURM_JOB_NAME": "train", "SLURM_NTASKS": "1", "SLURM_NTASKS_PER_NODE": "1",
         "SLURM_NNODES": "1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
         "SLURM_NODELIST": "localhost"}


def env_with(tmp_path: Path, slurm: dict[str, str] | None) -> tuple[dict[str, str], Path]:
    """The CLI's environment with a fake ``scontrol`` first on PATH (it records its arguments and the
    checkpoint directory at the moment it runs), SLURM's variables when ``slurm`` is given."""
    bin_dir, log = tmp_path / "bin", tmp_path / "scontrol.log"
    bin_dir.mkdir(exist_ok=True)
    scontrol = bin_dir / "scontrol"
    scontrol.write_text('#!/bin/sh\n{ echo "$*"; ls checkpoints; } >> "$SCONTROL_LOG"\n')
    scontrol.chmod(0o755)
    env = {k: v for k, v in cli_env().items() if not k.startswith("SLURM_")}  # also when the suite runs under SLURM
    env.update(slurm or {}, PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", SCONTROL_LOG=str(log))
    return env, log


# ----------------------------------------------------------------------------- torchrun on localhost

TORCHRUN = Path(sys.executable).with_name("torchrun")


def workers(launcher: subprocess.Popen) -> list[psutil.Process]:
    """torchrun's worker processes (each in a session of its own: a process-group kill misses them)."""
    try:
        return psutil.Process(launcher.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def kill_tree(launcher: subprocess.Popen) -> None:
    """SIGKILL a node: its torchrun and every worker, as when the machine goes away."""
    procs = workers(launcher)
    launcher.kill()
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass


@dataclass
class Nodes:
    returncodes: list[int | None]
    stdout: str  # node 0's (global rank 0 prints)
    stderr: list[str]
    rank1_stdout: str
    acted_at: float | None = None
    node0_exit_s: float | None = None  # node 0's torchrun exit, seconds after the action
    lines: list[tuple] = field(default_factory=list)

    @property
    def steps(self) -> dict[tuple[int, int], tuple[str, ...]]:
        return steps_of(self.lines)


def torchrun(cwd: Path, args: list[str], *, nnodes: int = 2, nproc: int = 1, max_restarts: int = 0,
             after_lines: int | None = None, action: Callable[[list[subprocess.Popen]], None] | None = None,
             reap: bool = False, timeout: float = 240) -> Nodes:
    """``torchrun ... -m lit_minimind.fit`` once per node on localhost (node 0 hosts the rendezvous);
    ``action(launchers)`` runs right after node 0 printed its ``after_lines``-th console line;
    ``reap`` kills the other nodes once node 0 exited (a hung node never exits by itself)."""
    port = free_port()
    launchers: list[subprocess.Popen] = []
    logs = [open(cwd / f"node{r}.{s}", "w+") for r in range(nnodes) for s in ("out", "err")]
    for rank in reversed(range(nnodes)):  # node 0 last: the others wait for it, as on a cluster
        # static rendezvous, as on a cluster; restarts need c10d's, with a fresh store per restart (the
        # shared one keeps the first attempt's gloo addresses: the restarted group cannot connect)
        rdzv = ["--standalone"] if max_restarts else ["--nnodes", str(nnodes), "--node_rank", str(rank),
                                                       "--master_addr", "127.0.0.1", "--master_port", str(port)]
        env = cli_env(**({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if max_restarts else {}))
        cmd = [str(TORCHRUN), *rdzv, "--nproc_per_node", str(nproc), "--max-restarts", str(max_restarts),
               "--monitor-interval", "0.2", "-m", "lit_minimind.fit", *args]
        launchers.insert(0, subprocess.Popen(cmd, cwd=cwd, env=env, text=True, start_new_session=True,
                                             stdout=subprocess.PIPE if rank == 0 else logs[2 * rank],
                                             stderr=logs[2 * rank + 1]))
    acted_at: list[float] = []
    exit_s, deadline = None, time.monotonic() + timeout

    def act(_running: Running) -> None:
        acted_at.append(time.monotonic())
        action(launchers)

    hook = at_line(after_lines, act) if action is not None and after_lines is not None else None
    watchdog = threading.Timer(timeout, lambda: [kill_tree(launcher) for launcher in launchers])
    watchdog.start()  # a hang fails the test instead of blocking it
    try:
        out, _, _ = follow(launchers[0], hook)
        launchers[0].wait(timeout=max(1.0, deadline - time.monotonic()))
        if acted_at:
            exit_s = time.monotonic() - acted_at[0]
        for launcher in launchers[1:]:
            if reap:
                kill_tree(launcher)
            launcher.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pytest.fail(f"a node still ran after {timeout} s (a hang): {[l.poll() for l in launchers]}")
    finally:
        watchdog.cancel()
        for launcher in launchers:
            if launcher.poll() is None:
                kill_tree(launcher)
                launcher.wait()
    stderr, rank1 = [], ""
    for i, log in enumerate(logs):
        log.seek(0)
        text = log.read()
        log.close()
        if i % 2:
            stderr.append(text)
        elif i:
            rank1 += text
    stdout = "".join(out)
    assert time.monotonic() < deadline, f"killed after {timeout} s (a hang)"
    return Nodes([l.returncode for l in launchers], stdout, stderr, rank1, acted_at[0] if acted_at else None, exit_s,
                 LINE_RE.findall(stdout))


# ----------------------------------------------------------------------------- an S3 server on localhost

SECRET = f"lit-minimind-test-secret-{uuid.uuid4().hex}"
KEY_ID = "AKIALITMINIMINDTEST"


@dataclass
class S3:
    """A moto S3 server on localhost; its buckets live in this process and survive stop/start.
    Needs ``moto[server]`` (extra ``test-s3``): a test using it calls ``pytest.importorskip("moto.server")``."""

    port: int
    bucket: str
    server: object | None = None

    def start(self) -> None:
        import moto.server as moto_server

        # one request per connection: a stopped server then refuses every request (no kept-alive connection)
        moto_server.MotoRequestHandler.protocol_version = "HTTP/1.0"
        self.server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()

    def stop(self) -> None:
        self.server.stop()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, *parts: str) -> str:
        return "/".join([f"s3://{self.bucket}", *parts])

    def env(self, **extra: str) -> dict[str, str]:
        return cli_env(AWS_ENDPOINT_URL=self.endpoint, AWS_ACCESS_KEY_ID=KEY_ID, AWS_SECRET_ACCESS_KEY=SECRET,
                       AWS_DEFAULT_REGION="us-east-1", AWS_CONFIG_FILE=os.devnull,
                       AWS_SHARED_CREDENTIALS_FILE=os.devnull, **extra)

    def fs(self):  # noqa: ANN201 (s3fs is optional)
        import s3fs

        return s3fs.S3FileSystem(key=KEY_ID, secret=SECRET, endpoint_url=self.endpoint, skip_instance_cache=True,
                                 use_listings_cache=False, client_kwargs={"region_name": "us-east-1"})


# ----------------------------------------------------------------------------- MiniMind's post-training stages

POST = MINIMIND / "post"
SFT_EXPORT = MINIMIND / "sft" / "out__full_sft_64.pth"
RUNS = json.loads((POST / "runs.json").read_text()) if POST.exists() else {}
QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]
PRESET = {"lora": ROOT / "conf" / "minimind_lora.yaml", "dpo": ROOT / "conf" / "minimind_dpo.yaml"}


def minimind_argv(run: str, preset_last: bool = False) -> list[str]:
    """``--config <preset>``, then runs.json's argv of MiniMind's script with the shared data, then
    ``--save_dir out`` and the shared tokenizer (``preset_last``: the preset after MiniMind's argv)."""
    stage = run.split("_")[0]
    argv = list(RUNS[run]["argv"][2:])  # without "python trainer/train_*.py"
    argv[argv.index("--data_path") + 1] = str(POST / f"{stage}.jsonl")
    preset = ["--config", str(PRESET[stage])]
    if preset_last:
        return [*argv, "--save_dir", "out", *preset, "--tokenizer_path", str(TOKENIZER), *QUIET]
    return [*preset, *argv, "--save_dir", "out", "--tokenizer_path", str(TOKENIZER), *QUIET]


def start_from_sft(run_dir: Path) -> None:
    """MiniMind's --from_weight full_sft: {save_dir}/full_sft_64.pth."""
    (run_dir / "out").mkdir(parents=True, exist_ok=True)
    shutil.copy(SFT_EXPORT, run_dir / "out" / "full_sft_64.pth")


def assert_steps(got: dict, expected: list[dict], loss_key: str) -> None:
    """Every printed step: MiniMind's loss, its second loss (logits_loss or dpo_loss), aux_loss and lr."""
    assert sorted(got) == [(s["epoch"] + 1, s["step"]) for s in expected]
    for s in expected:
        loss, second, aux_loss, lr = (float(x) for x in got[(s["epoch"] + 1, s["step"])])
        assert abs(loss - s["loss"]) <= 2e-4, (s["epoch"], s["step"], loss, s["loss"])
        assert abs(second - s[loss_key]) <= 2e-4, (s["epoch"], s["step"], second, s[loss_key])
        assert abs(aux_loss - s["aux_loss"]) <= 2e-4
        assert abs(lr - s["lr"]) <= 1e-8, (s["step"], lr, s["lr"])


def minimind_model(lora: bool = False):  # noqa: ANN201
    """MiniMind's 64x2 model (ours is key-for-key MiniMind's), with MiniMind's adapters if asked."""
    from lit_minimind.model import MiniMindConfig, MiniMindForCausalLM
    from lit_minimind.model.lora import apply_lora

    config = MiniMindConfig.from_dict(json.loads((MINIMIND / "parity" / "dense_config.json").read_text()))
    model = MiniMindForCausalLM(config)
    if lora:
        apply_lora(model)
    return model


def tiny_lora_args(workers: int = 0) -> list[str]:
    """MiniMind's LoRA stage, small (2 epochs), from ``out/full_sft_64.pth`` (:func:`start_from_sft`)."""
    return ["--data.data_path", str(POST / "lora.jsonl"), "--data.tokenizer_path", str(TOKENIZER),
            "--model.hidden_size", "64", "--model.num_hidden_layers", "2", "--model.lora_rank", "16",
            "--data.max_seq_len", "128", "--data.batch_size", "4", "--model.learning_rate", "1e-3",
            "--trainer.accumulate_grad_batches", "2", "--trainer.max_epochs", "2", "--trainer.accelerator", "cpu",
            "--trainer.devices", "1", "--log_interval", "1", "--resume.save_interval", "3", "--from_weight",
            "out/full_sft_64.pth", "--data.num_workers", str(workers), *QUIET]
