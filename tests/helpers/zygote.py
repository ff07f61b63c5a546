"""Test-only: start ``python -m lit_minimind.fit`` by forking a Python that has already imported it.

A tiny run costs about 6 s of CPU, two thirds of it importing torch and Lightning, and the suites start
hundreds. :func:`tests.helpers.runs.run_cli` hands each run of the CLI to a *zygote*: a Python started
once per test process with the run's environment (twice: see the hash seed below), that imported what
``python -m lit_minimind.fit`` imports before its ``main`` (``lit_minimind/fit.py`` as the entry point: its
early signal handlers, its torchmetrics import hook) and then waits. For each run it forks a watcher, which forks the run:

- the run is a real process in a session of its own (``start_new_session``), its stdout and stderr the
  test's pipes, stdin ``/dev/null``, its cwd, environment and ``sys.argv`` those of the request; signals
  reset to a fresh Python's, ``random`` reseeded; the test fault injection installed if its environment
  asks for it (as ``tests/helpers/site/sitecustomize.py`` does at a fresh start); then ``lit_minimind.fit``
  runs as ``__main__`` (so Lightning's DDP launcher starts the other ranks with ``-m lit_minimind.fit``,
  as fresh Pythons) and the process exits as that one would, atexit handlers included;
- the watcher sends the run's pid, then its wait status, over a pipe: :class:`Forked` is the part of
  ``subprocess.Popen`` the tests use (``pid``, ``stdout``, ``stderr``, ``poll``, ``wait``, ``kill``,
  ``returncode``), and a signal the test sends goes to the run itself.

A fresh Python draws its string-hash seed at start; a fork keeps its zygote's. So each zygote starts with a
``PYTHONHASHSEED`` of its own (no two of a test process alike; the forked run's own environment has none, as
a launched one's), unless the run's environment sets one, and the runs of one environment alternate between
two zygotes: a run and the next (the uninterrupted run and the interrupted one, the interrupted one and its
resume) hash strings differently, as two launched Pythons do, so code that depends on hash order across
processes shows (``tests/test_zygote.py`` checks it).

What this does not cover, a launch does: signals during the imports (``tests/test_startup_signals.py``
starts its own Pythons for those), another command (``run_cli(command=...)``), a mutant run
(``LIT_MINIMIND_MUTANT``: its patches are applied at interpreter start), and ``LIT_MINIMIND_FORK=0``
(every run a fresh Python, e.g. to compare). The zygote refuses to serve, and every run is launched, if
its imports left a second thread (forking a threaded process is unsafe).
"""

from __future__ import annotations

import atexit
import json
import os
import random
import select
import signal
import socket
import struct
import subprocess
import sys
from pathlib import Path

from tests.helpers import faults

ROOT = Path(__file__).resolve().parents[2]
MAX_ZYGOTES = 6  # per test process: two per environment (less the fault keys), the least recently used closed first
HASH_SEEDS = 2**32 - 1  # PYTHONHASHSEED 1..4294967295 (0 turns the randomization off)
_WORD = struct.Struct("q")


class Forked:
    """A run forked by a zygote: what the tests use of ``subprocess.Popen``."""

    def __init__(self, args: list[str], pid: int, stdout: int, stderr: int, status: int) -> None:
        self.args, self.pid, self.returncode = args, pid, None
        self.stdout, self.stderr = open(stdout), open(stderr)  # as Popen(text=True): locale encoding
        self._status = status

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._status], [], [], 0)[0]:
            self._read_status()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._status], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._read_status()
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def _read_status(self) -> None:
        data = os.read(self._status, _WORD.size)
        os.close(self._status)
        if len(data) != _WORD.size:
            raise RuntimeError(f"the zygote's watcher of run {self.pid} ended without its exit status")
        self.returncode = os.waitstatus_to_exitcode(_WORD.unpack(data)[0])


class Zygote:
    """One pre-imported Python (its environment fixed at start), serving fork requests over a socket."""

    def __init__(self, env: dict[str, str], hash_seed: int) -> None:
        """A zygote with ``env``, its string-hash seed ``hash_seed`` unless ``env`` sets ``PYTHONHASHSEED``."""
        env = {"PYTHONHASHSEED": str(hash_seed), **env}
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.helpers.zygote", str(theirs.fileno())], cwd=ROOT,
                                     env=env, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL)
        theirs.close()
        self.sock = ours

    def start(self, args: list[str], cwd: Path, env: dict[str, str]) -> Forked | None:
        """Fork a run of ``python -m lit_minimind.fit ARGS``; None if this zygote does not serve."""
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        status_r, status_w = os.pipe()
        request = json.dumps({"args": args, "cwd": os.path.abspath(cwd), "env": env}).encode()
        try:
            socket.send_fds(self.sock, [request], [out_w, err_w, status_w])
            sent = True
        except OSError:  # the zygote is gone (it refused to serve, or died)
            sent = False
        finally:  # before the read: a zygote that dies with the request still queued (its imports failed)
            for fd in (out_w, err_w, status_w):  # closes the last write end, and the read sees the end
                os.close(fd)
        pid = os.read(status_r, _WORD.size) if sent else b""  # once the watcher forked the run; b"": it ended
        if len(pid) != _WORD.size:
            for fd in (out_r, err_r, status_r):
                os.close(fd)
            return None
        return Forked(args, _WORD.unpack(pid)[0], out_r, err_r, status_r)

    def close(self) -> None:
        self.sock.close()  # the zygote ends at the end of its socket
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_zygotes: dict[tuple, Zygote] = {}  # (environment key, 0 or 1) -> its zygote, the most recently used last
_runs: dict[tuple, int] = {}  # environment key -> runs started: the next goes to zygote (runs % 2)
_first_seed = random.SystemRandom().randrange(HASH_SEEDS)
_started = 0  # zygotes started by this test process: each gets the next hash seed (all differ)


def key_of(env: dict[str, str]) -> tuple:
    """A zygote's environment: the run's, less the fault injection's keys (read at run time)."""
    return tuple(sorted((k, v) for k, v in env.items() if not k.startswith(faults.ENV_PREFIXES)))


def start(args: list[str], cwd: Path, env: dict[str, str]) -> Forked | None:
    """A forked run of ``python -m lit_minimind.fit ARGS`` in ``cwd`` with ``env``, or None: launch it."""
    if os.environ.get("LIT_MINIMIND_FORK", "1") == "0" or env.get("LIT_MINIMIND_MUTANT"):
        return None
    global _started
    key = key_of(env)
    runs = _runs[key] = _runs.get(key, 0) + 1
    slot = (key, 0 if "PYTHONHASHSEED" in env else runs % 2)  # the environment's own seed: one zygote is enough
    zygote = _zygotes.pop(slot, None)
    if zygote is None:
        if len(_zygotes) >= MAX_ZYGOTES:
            _zygotes.pop(next(iter(_zygotes))).close()
        zygote = Zygote(dict(key), 1 + (_first_seed + _started) % HASH_SEEDS)
        _started += 1
    _zygotes[slot] = zygote  # the most recently used last
    return zygote.start(args, cwd, env)


@atexit.register
def _close_all() -> None:
    while _zygotes:
        _zygotes.popitem()[1].close()


# ----------------------------------------------------------------------------- inside the zygote

FRESH_HANDLERS = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL,
                  signal.SIGUSR1: signal.SIG_DFL}  # SIGCHLD: the watcher resets it


def serve(fd: int) -> int:
    """The zygote: import what the CLI imports, then fork a watcher per request until the socket ends."""
    sock = socket.socket(fileno=fd)
    argv0, sys.argv[0] = sys.argv[0], "lit-minimind-fit"  # lit_minimind/fit.py's entry-point set-up
    import lit_minimind.fit  # noqa: F401  (seconds: torch, Lightning)

    sys.argv[0] = argv0
    for signum, handler in FRESH_HANDLERS.items():
        signal.signal(signum, handler)
    threads = len(os.listdir("/proc/self/task"))
    if threads > 1:
        print(f"tests/helpers/zygote.py: {threads} threads after the imports: not forking, every run is launched",
              file=sys.stderr)
        return 0
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the watchers: reaped by the kernel
    while True:
        request, fds, _flags, _addr = socket.recv_fds(sock, 1 << 20, 3)
        if not request:
            return 0
        if os.fork() == 0:
            sock.close()
            watch(*fds)  # returns in the run's process only
            return run(json.loads(request))
        for received in fds:
            os.close(received)


def watch(stdout: int, stderr: int, status: int) -> None:
    """The watcher: fork the run, send its pid, wait for it, send its wait status, exit."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    pid = os.fork()
    if pid == 0:
        os.close(status)
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDONLY)
        for fd, target in ((devnull, 0), (stdout, 1), (stderr, 2)):
            os.dup2(fd, target)
            os.close(fd)
        return
    os.close(stdout), os.close(stderr)
    os.write(status, _WORD.pack(pid))
    _, wait_status = os.waitpid(pid, 0)
    os.write(status, _WORD.pack(wait_status))
    os._exit(0)


def run(request: dict) -> int:
    """In the forked run: become ``python -m lit_minimind.fit ARGS`` started in ``cwd`` with ``env``."""
    import random
    import runpy

    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    random.seed()  # a fresh Python's: seeded from the OS
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()
    if faults.wanted():  # as tests/helpers/site/sitecustomize.py at a fresh start
        faults.install()
    sys.argv[1:] = request["args"]
    sys.path[0] = request["cwd"]  # python -m puts the cwd first
    del sys.modules["lit_minimind.fit"]  # run as __main__, once (no runpy warning)
    runpy.run_module("lit_minimind.fit", run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(serve(int(sys.argv[1])))
