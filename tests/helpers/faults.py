"""Test-only: faults and pauses inside the project's atomic writer, from outside the package.

Installed in every process the tests start (``tests/helpers/site/sitecustomize.py``, on the
``PYTHONPATH`` of :func:`tests.helpers.runs.cli_env`) when one of the variables below is set.

A write is addressed by what it commits, never by a count of all commits (one more file per save would
shift every count): ``KIND`` is ``checkpoint`` (a Lightning ``.ckpt`` of a save), ``best`` (``{stem}_best.ckpt``),
``resume`` (MiniMind's ``_resume.pth``: in a save, a hard link to its checkpoint), ``export`` (MiniMind's fp16 ``.pth``) or
``directory`` (a directory written at once: the Hugging Face export, a tokenizer), and ``N`` counts the commits of
that kind in this process (a save commits its checkpoint, then its ``_resume.pth``, then its export). The variables:

* ``LIT_MINIMIND_TEST_FAIL=OP:KIND:N:ERRNO``: the N-th ``OP`` on a file of that kind fails with ``ERRNO``
  (``ENOSPC``, ``EIO``, ...), as a full or failing disk would. ``OP``: ``write`` (the data's first write),
  ``fsync`` (the data file's), ``manifest`` (writing its manifest), ``rename`` (the data into place),
  ``dirfsync`` (the directory after the rename), ``link`` (the hard link of ``_resume.pth``).
* ``LIT_MINIMIND_TEST_STOP_IN_SAVE=N:KIND``: the N-th commit of that kind stops the process (SIGSTOP) with
  its tmp file complete, manifest written, not yet renamed; ``LIT_MINIMIND_TEST_STOP_AFTER_SAVE=N:KIND``
  right after the commit. It prints ``@@stopped-in-save PATH`` / ``@@stopped-after-save PATH`` first; a test
  then SIGKILLs it there, deterministically.
* ``LIT_MINIMIND_TEST_HANG_IN_SAVE=N:KIND``: the N-th commit of that kind never returns, as on a filesystem
  that stopped answering: the thread writing it (the background writer, or the loop with synchronous saves)
  blocks forever before the rename, the rest of the process runs on. It prints ``@@hanging-in-save PATH``.

It is a test implementation of the writer's file operations (:class:`tests.helpers.faulty_storage.FaultyFileOps`, a
:class:`lit_minimind.checkpoint.atomic.FileOps`): each operation knows the file it commits; files written without a
manifest (caches, logs: ``atomic_open``) pass through untouched. The product takes its ``FileOps`` as an argument
(``CheckpointManager(ops=...)``, ``SafeCheckpointIO(ops=...)``) and has no switch for tests: :func:`install` makes
``FaultyFileOps`` the package's default ``FileOps`` in a test process before the package is imported (a process the
tests start: ``tests/helpers/site/sitecustomize.py``; in the pytest process: ``monkeypatch``).
"""

from __future__ import annotations

import errno
import os
import signal
import threading
from typing import Any

KINDS = ("checkpoint", "best", "resume", "export", "directory")
SAVE_FILES = ("checkpoint", "resume", "export")  # what a save commits, in this order
_counts: dict[tuple[str, str], int] = {}


def kind_of(name: str, directory: bool = False) -> str | None:
    """What a commit of ``name`` is (one of :data:`KINDS`), None for anything else (a data index, a corpus)."""
    if directory:
        return "directory"
    for kind, suffix in (("resume", "_resume.pth"), ("best", "_best.ckpt"), ("checkpoint", ".ckpt"), ("export", ".pth")):
        if name.endswith(suffix):
            return kind
    return None


def is_the_commit(counter: str, spec: str, kind: str | None) -> bool:
    """Whether this commit of ``kind`` is the one ``spec`` (``N:KIND``) names; counts it."""
    count, sep, want = spec.partition(":")
    if not sep or want not in KINDS:
        raise ValueError(f"a fault names N:KIND with KIND one of {', '.join(KINDS)}, not {spec!r}")
    if kind != want:
        return False
    _counts[counter, kind] = _counts.get((counter, kind), 0) + 1
    return _counts[counter, kind] == int(count)


def fault(op: str, kind: str | None, path: Any) -> None:
    spec = os.environ.get("LIT_MINIMIND_TEST_FAIL")
    if not spec:
        return
    want, kind_spec, nth, code = spec.split(":")
    if want == op and is_the_commit(f"fail-{op}", f"{nth}:{kind_spec}", kind):
        number = getattr(errno, code)
        raise OSError(number, os.strerror(number), str(path))


def pause(moment: str, kind: str | None, path: Any) -> None:
    spec = os.environ.get(f"LIT_MINIMIND_TEST_STOP_{moment.upper()}_SAVE")
    if spec and is_the_commit(moment, spec, kind):
        print(f"@@stopped-{moment}-save {path}", flush=True)
        # to this thread (the background writer, maybe): it stops here, before its next instruction
        signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)


def hang(kind: str | None, path: Any) -> None:
    spec = os.environ.get("LIT_MINIMIND_TEST_HANG_IN_SAVE")
    if spec and is_the_commit("hang", spec, kind):
        print(f"@@hanging-in-save {path}", flush=True)
        threading.Event().wait()  # this thread only: the others (the training loop, maybe) go on


def install() -> None:
    """Every ``FileOps`` the package makes by default is a ``FaultyFileOps`` from now on."""
    from lit_minimind.checkpoint import atomic
    from tests.helpers.faulty_storage import FaultyFileOps

    atomic.FileOps = FaultyFileOps  # type: ignore[misc]


ENV_PREFIXES = ("LIT_MINIMIND_TEST_FAIL", "LIT_MINIMIND_TEST_STOP_", "LIT_MINIMIND_TEST_HANG_")  # read at run time


def wanted() -> bool:
    return any(k.startswith(ENV_PREFIXES) for k in os.environ)
