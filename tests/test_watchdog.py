"""Hangs end themselves (``--watchdog.*``, :mod:`lit_minimind.callbacks.watchdog`): a rank that completes
no optimizer step within its bound writes every thread's stack and one line naming the rank, the phase
and the seconds waited, and exits 6; ``--ckpt_path last`` then resumes exactly. Real processes; the
tests wait on output lines (the ``@@`` lines of tests/helpers/hang.py and tests/helpers/faults.py), and
the bounds are a few seconds."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from lit_minimind.callbacks.watchdog import HANG_EXIT
from tests.helpers.runs import (
    LINE_RE,
    Run,
    assert_resumed,
    cli_env,
    expected_resume,
    kill_session,
    need_shared,
    rank_pid,
    resumed_at,
    run_cli,
    tiny_args,
)

HANG_LINE = re.compile(r"\[rank (\d+)\] error: hang: no optimizer step completed for ([\d.]+) s in phase ([\w/-]+) "
                       r".*Exiting with code 6: restart with the same command plus --ckpt_path last")
LIMIT_S = 180  # a run still going after this long fails its test (the watchdog under test did not fire)


def bounds(floor: float = 4, save: float = 4, startup: float = 20, factor: float = 20) -> list[str]:
    return ["--watchdog.floor", str(floor), "--watchdog.save", str(save), "--watchdog.startup", str(startup),
            "--watchdog.factor", str(factor)]


class Live:
    """``python -m lit_minimind.fit`` in its own session, its output read by threads while it runs; killed,
    with every process of its session, if it outlives ``LIMIT_S``."""

    def __init__(self, cwd: Path, args: list[str], env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "lit_minimind.fit", *args], cwd=cwd, env=env or cli_env(),
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.out: list[str] = []
        self.err: list[str] = []
        self._readers = [threading.Thread(target=self._read_stdout, daemon=True),
                         threading.Thread(target=lambda: self.err.extend(self.proc.stderr), daemon=True)]
        for reader in self._readers:
            reader.start()
        self.killed = threading.Event()
        self._timer = threading.Timer(LIMIT_S, self._kill_all)
        self._timer.start()

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.out.append(line)
            self.lines.put(line)
        self.lines.put(None)

    def _kill_all(self) -> None:
        self.killed.set()
        self.kill_group()

    def kill_group(self) -> None:
        kill_session(self.proc.pid)

    def session(self, grace: float = 5) -> list[psutil.Process]:
        """The processes still alive in the run's session (zombies aside), once those already dying (a
        worker the watchdog SIGKILLed an instant before its rank exited) had up to ``grace`` s to go."""
        found = []
        for proc in psutil.process_iter():
            try:
                if os.getsid(proc.pid) == self.proc.pid:
                    found.append(proc)
            except (ProcessLookupError, PermissionError, psutil.Error):
                continue
        deadline = time.monotonic() + grace
        while (alive := [p for p in found if not is_zombie(p)]) and time.monotonic() < deadline:
            psutil.wait_procs(alive, timeout=0.1)  # at most 0.1 s; the check above counts an unreaped zombie as gone
        return alive

    def until(self, pattern: str) -> str:
        """The next stdout line matching ``pattern`` (blocks until it comes); fails if the output ends first."""
        while (line := self.lines.get()) is not None:
            if re.search(pattern, line):
                return line
        pytest.fail(f"the run ended without a line matching {pattern!r}:\n{''.join(self.err)[-3000:]}")

    def finish(self) -> Run:
        """Wait for the process; then every process left in its session (a stopped DDP rank, a stuck
        worker) is SIGKILLed, as a scheduler would, and its output read to the end."""
        self.proc.wait()
        self._timer.cancel()
        self.left = self.session()
        self.kill_group()
        for reader in self._readers:
            reader.join(timeout=30)
        assert not self.killed.is_set(), f"the run was still going after {LIMIT_S} s:\n{''.join(self.err)[-3000:]}"
        stdout = "".join(self.out)
        return Run(self.proc.returncode, stdout, "".join(self.err), LINE_RE.findall(stdout))


def is_zombie(proc: psutil.Process) -> bool:
    """Exited (its parent has yet to reap it) or gone."""
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True  # gone meanwhile


def hang_line(run: Run) -> re.Match:
    found = [m for m in map(HANG_LINE.search, run.stderr.splitlines()) if m]
    assert len(found) == 1, f"expected one hang line:\n{run.stderr[-4000:]}"
    return found[0]


def ddp_config(*extra: str) -> list[str]:
    """2 processes, 2 epochs of 6 batches per rank, an optimizer step every 2, saves at step 2, 4, 6."""
    return tiny_args(*extra, epochs=2, accumulate=2, save_interval=2, devices=2)


@pytest.fixture(scope="module")
def ddp_reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    need_shared()
    ref_dir = tmp_path_factory.mktemp("ref")
    ref = run_cli(ref_dir, ddp_config())
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert len(ref.steps) == 12
    return ref_dir, ref.steps


@pytest.mark.slow  # make test's budget: in make test-slow
def test_a_stopped_rank_ends_rank_0_within_the_bound_and_the_resume_is_exact(tmp_path: Path, ddp_reference) -> None:
    """Rank 1 SIGSTOPped mid-epoch (a machine that stops answering: no connection error, gloo waits 30 min):
    rank 0's watchdog ends it within its bound with the line and exit 6; the job killed, ``--ckpt_path last``
    resumes where the last save left it and ends as the uninterrupted run."""
    ref_dir, ref_steps = ddp_reference
    live = Live(tmp_path, ddp_config(*bounds(floor=4, save=4)))
    live.until(r"Epoch:\[1/2\]\(3/6\)")
    frozen = rank_pid(live.proc, 1)
    os.kill(frozen, signal.SIGSTOP)
    stopped_at = time.monotonic()
    hung = live.finish()
    exit_s = time.monotonic() - stopped_at
    assert hung.returncode == HANG_EXIT, hung.stderr[-3000:]
    # the frozen rank, rank 0's child (Lightning's launcher), does not outlive it: SIGKILLed, and said
    assert f"[rank 0] watchdog: ended the 1 other rank process(es) this one launched (pid {frozen}) with SIGKILL" \
        in hung.stderr, hung.stderr[-3000:]
    try:
        psutil.Process(frozen).wait(timeout=10)  # gone (its new parent reaps it), not stopped for good
    except psutil.NoSuchProcess:
        pass
    m = hang_line(hung)
    assert m[1] == "0"  # rank 1 is stopped: only rank 0 speaks
    assert m[3] in ("forward/backward", "optimizer/collective", "save", "data"), m[0]
    # the bound: the floor (4 s; tiny steps: 20 x median is less) or the save bound (4 s); the exit comes
    # at once after it (a loaded machine: a few seconds more), long before gloo's 30-minute timeout
    assert 4 <= float(m[2]) < 12, m[0]
    assert exit_s < 30, exit_s
    assert "Thread 0x" in hung.stderr and "(most recent call first)" in hung.stderr  # every thread's stack
    assert "Traceback" not in hung.stderr
    print(f"rank 0 exited {exit_s:.1f} s after rank 1 stopped: {m[0]}")

    where = expected_resume(tmp_path, iters=6)
    assert where is not None and where <= (1, 5), where  # the save at step 2 (or 4) was committed
    resumed = run_cli(tmp_path, ddp_config("--ckpt_path", "last"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_resumed(resumed, *where)
    assert max(resumed.steps) == (2, 6)
    for run in (hung, resumed):
        for key, values in run.steps.items():
            assert values == ref_steps[key], f"step {key} differs"
    ref_w = torch.load(ref_dir / "out" / "pretrain_64.pth", weights_only=True)
    got_w = torch.load(tmp_path / "out" / "pretrain_64.pth", weights_only=True)
    assert all(torch.equal(ref_w[k], got_w[k]) for k in ref_w)


@pytest.mark.slow  # make test's budget: 14.6 min on a clean clone, 2026-12-03 (make test-slow)
def test_a_data_worker_that_blocks_forever_is_named_phase_data(tmp_path: Path) -> None:
    """A DataLoader worker stuck in a read (its 17th record: batch 5): the loop waits for the batch, the
    watchdog names phase ``data``; ``--watchdog.stacks`` puts the stacks in a file the line names."""
    need_shared()
    stacks = tmp_path / "stacks" / "rank{rank}.txt"
    live = Live(tmp_path, tiny_args(*bounds(floor=3), "--data.num_workers", "1", "--watchdog.stacks", str(stacks),
                                    "--trainer.callbacks+=tests.helpers.hang.HangInData",
                                    "--trainer.callbacks.item=17"))
    live.until("@@hanging-in-data")
    run = live.finish()
    assert run.returncode == HANG_EXIT, run.stderr[-3000:]
    m = hang_line(run)
    assert (m[1], m[3]) == ("0", "data"), m[0]
    assert 3 <= float(m[2]) < 10, m[0]
    assert max(run.steps) == (1, 4)  # batches 1-4 trained; the 5th never came
    assert live.left == [], live.left  # the stuck worker went with its rank (SIGKILLed by the watchdog)
    written = tmp_path / "stacks" / "rank0.txt"
    assert f"every thread's stack in {written}" in m[0]
    text = written.read_text()
    assert "torch/utils/data/dataloader.py" in text and "in _get_data" in text  # the main thread, waiting


@pytest.mark.parametrize("async_save", ["true", "false"])
def test_a_save_that_never_finishes_is_named_phase_save(tmp_path: Path, async_save: str) -> None:
    """The first checkpoint's write blocks forever (a filesystem that stops answering). In the background
    (``async_save``) the loop trains on and waits for it at the next save; in the loop, it waits there at
    once: either way the watchdog names phase ``save`` after ``--watchdog.save``, the floor being larger."""
    need_shared()
    live = Live(tmp_path, tiny_args(*bounds(floor=60, save=3), "--resume.save_interval", "2",
                                    "--resume.async_save", async_save),
                env=cli_env(LIT_MINIMIND_TEST_HANG_IN_SAVE="1:checkpoint"))
    live.until("@@hanging-in-save")
    run = live.finish()
    assert run.returncode == HANG_EXIT, run.stderr[-3000:]
    m = hang_line(run)
    assert (m[1], m[3]) == ("0", "save"), m[0]
    assert "past --watchdog.save 3 s" in m[0]
    assert 3 <= float(m[2]) < 10, m[0]
    waits_in = "_begin_save" if async_save == "true" else "atomic_save"  # the next save's wait / the write itself
    assert waits_in in run.stderr
    assert max(run.steps) == ((1, 4) if async_save == "true" else (1, 2))


@pytest.mark.slow  # make test's budget: in make test-slow
def test_the_last_save_that_never_finishes_at_the_end_of_training(tmp_path: Path) -> None:
    """The epoch's end is the only save, and its write never returns: the end of training waits for it
    (ResumeCallback.on_train_end), still watched, as a save."""
    need_shared()
    live = Live(tmp_path, tiny_args(*bounds(floor=60, save=3), "--resume.save_interval", "100"),
                env=cli_env(LIT_MINIMIND_TEST_HANG_IN_SAVE="1:checkpoint"))
    live.until("@@hanging-in-save")
    run = live.finish()
    assert run.returncode == HANG_EXIT, run.stderr[-3000:]
    m = hang_line(run)
    assert m[3] == "save" and "last hook on_train_end" in m[0], m[0]
    assert "in on_train_end" in run.stderr  # the main thread's stack: ResumeCallback waits there
    assert max(run.steps) == (1, 12)


@pytest.mark.slow  # make test's budget: in make test-slow
def test_no_false_alarm_for_a_slow_start_a_slow_step_validation_and_epoch_starts(tmp_path: Path) -> None:
    """The first batch takes 5 s (compile, a cold cache: past the 2 s floor, within the start-up bound),
    one later batch 10 x the median batch time, a validation split is validated at each epoch's end, and
    epoch 2 starts its loader again: no hang line, the run ends normally."""
    need_shared()
    run = run_cli(tmp_path, tiny_args(*bounds(floor=2, save=10, startup=15, factor=20), "--data.val_fraction", "0.2",
                                      "--trainer.callbacks+=tests.helpers.hang.SlowSteps", "--trainer.callbacks.first=5",
                                      "--trainer.callbacks.slow_batch=7", "--trainer.callbacks.times=10", epochs=2))
    assert run.returncode == 0, run.stderr[-3000:]
    assert "@@slow-first-batch" in run.stdout and "@@slow-batch 7" in run.stdout
    assert "hang" not in run.stderr, run.stderr[-3000:]
    assert max(run.steps)[0] == 2


@pytest.mark.slow  # make test's budget: in make test-slow
def test_a_c_call_that_holds_the_gil_is_ended_by_faulthandler(tmp_path: Path) -> None:
    """The main thread in a C call that never releases the GIL: no Python thread runs, the watchdog's
    neither; faulthandler's C timer, armed 10 s after the largest bound, dumps the stacks and exits 1."""
    need_shared()
    live = Live(tmp_path, tiny_args(*bounds(floor=2, save=2, startup=3),
                                    "--trainer.callbacks+=tests.helpers.hang.HoldTheGil", "--trainer.callbacks.batch=4"))
    live.until("@@holding-the-gil")
    held_at = time.monotonic()
    run = live.finish()
    held_s = time.monotonic() - held_at
    assert run.returncode == 1, run.stderr[-3000:]
    assert "Timeout (0:00:" in run.stderr and "tests/helpers/hang.py" in run.stderr, run.stderr[-3000:]
    assert 5 < held_s < 40, held_s  # the largest bound (3 s) + 10 s after the last step


@pytest.mark.slow  # make test's budget: 14.6 min on a clean clone, 2026-12-03 (make test-slow)
def test_watchdog_bounds_must_be_positive(tmp_path: Path) -> None:
    need_shared()
    for flag, value, words in [("floor", "0", "--watchdog.floor must be > 0 seconds, got 0.0"),
                               ("factor", "-1", "--watchdog.factor must be > 0, got -1.0")]:
        run = run_cli(tmp_path, tiny_args(f"--watchdog.{flag}", value))
        assert run.returncode == 2, run.stderr[-2000:]
        errors = [line for line in run.stderr.splitlines() if "error:" in line]
        assert errors == [f"error: {words}"], run.stderr[-2000:]


@pytest.mark.slow  # torchrun waits its fixed 30 s for the stopped rank before it restarts the group
def test_torchrun_restarts_a_hung_job_which_resumes_exactly(tmp_path: Path, ddp_reference) -> None:
    """``torchrun --standalone --max-restarts 1``: rank 1 stops answering (SIGSTOP, first attempt only);
    rank 0's watchdog exits 6, torchrun ends the group and starts it again with the same command line,
    whose ``--ckpt_path last`` resumes; every step of both attempts equals the uninterrupted run's."""
    from tests.helpers.runs import torchrun  # the localhost torchrun runner

    ref_dir, ref_steps = ddp_reference
    run = torchrun(tmp_path, ddp_config("--ckpt_path", "last", *bounds(floor=4, save=4),
                                        "--trainer.callbacks+=tests.helpers.hang.StopSelf", "--trainer.callbacks.rank=1",
                                        "--trainer.callbacks.batch=4"),
                   nnodes=1, nproc=2, max_restarts=1, timeout=300)
    assert run.returncodes == [0], run.stderr[0][-3000:]
    assert "@@stopping-self rank 1" in run.stdout + run.rank1_stdout + run.stderr[0]
    hang = [m for m in map(HANG_LINE.search, run.stderr[0].splitlines()) if m]
    assert [m[1] for m in hang] == ["0"], run.stderr[0][-3000:]
    assert f"failed (exitcode: {HANG_EXIT}) local_rank: 0" in run.stderr[0], run.stderr[0][-3000:]  # torchrun's
    assert resumed_at(run.stderr[0]) is not None, "the restarted group did not resume"
    assert len(run.lines) > 12  # both attempts' lines: the second repeats the steps since the last save
    for m in run.lines:
        key = (int(m[0]), int(m[2]))
        assert (m[4], m[5], m[6], m[7]) == ref_steps[key], f"step {key} differs"
    ref_w = torch.load(ref_dir / "out" / "pretrain_64.pth", weights_only=True)
    got_w = torch.load(tmp_path / "out" / "pretrain_64.pth", weights_only=True)
    assert all(torch.equal(ref_w[k], got_w[k]) for k in ref_w)
