"""Test-only: faults and pauses inside the project's atomic writer, from outside the package.

Installed in every process the tests start (``tests/helpers/site/sitecustomize.py``, on the
``PYTHONPATH`` of :func:`tests.helpers.runs.cli_env`) when one of these variables is set:

* ``LIT_MINIMIND_TEST_FAIL=OP:SUFFIX:N:ERRNO``: the N-th ``OP`` on a file whose name ends with
  ``SUFFIX`` fails with ``ERRNO`` (``ENOSPC``, ``EIO``, ...), as a full or failing disk would. ``OP``:
  ``write`` (the data's first write), ``fsync`` (the data file's), ``manifest`` (writing its manifest),
  ``rename`` (the data into place), ``dirfsync`` (the directory after the rename), ``link`` (the hard
  link of ``_resume.pth``).
* ``LIT_MINIMIND_TEST_STOP_IN_SAVE=N[:SUFFIX]``: the N-th commit of a checkpoint file (with that
  suffix) stops the process (SIGSTOP) with its tmp file complete, manifest written, not yet renamed;
  ``LIT_MINIMIND_TEST_STOP_AFTER_SAVE`` right after the commit. It prints ``@@stopped-in-save PATH`` /
  ``@@stopped-after-save PATH`` first; a test then SIGKILLs it there, deterministically.
* ``LIT_MINIMIND_TEST_HANG_IN_SAVE=N[:SUFFIX]``: the N-th commit of a checkpoint file (with that suffix)
  never returns, as on a filesystem that stopped answering: the thread writing it (the background
  writer, or the loop with synchronous saves) blocks forever before the rename, the rest of the process
  runs on. It prints ``@@hanging-in-save PATH`` first.

It is a test implementation of the writer's storage (:class:`tests.helpers.faulty_storage.FaultyStorage`, a
:class:`lit_minimind.checkpoint.atomic.LocalStorage` installed with ``use_storage``): each operation
knows the file it commits, so a fault addresses a write by what it is (``.ckpt``: the checkpoint,
``_resume.pth``: its link, ``.pth``: the export; ``manifest``: a manifest's write); files written without a
manifest (caches, logs: ``atomic_open``) pass through untouched.
"""

from __future__ import annotations

import errno
import os
import signal
import threading
from typing import Any

_faults_seen: dict[str, int] = {}
_commits: dict[str, int] = {}


def fault(op: str, name: str, path: Any) -> None:
    spec = os.environ.get("LIT_MINIMIND_TEST_FAIL")
    if not spec:
        return
    want, suffix, nth, code = spec.split(":")
    if want != op or not name.endswith(suffix):
        return
    _faults_seen[op] = _faults_seen.get(op, 0) + 1
    if _faults_seen[op] == int(nth):
        number = getattr(errno, code)
        raise OSError(number, os.strerror(number), str(path))


def pause(moment: str, name: str, path: Any) -> None:
    target = os.environ.get(f"LIT_MINIMIND_TEST_STOP_{moment.upper()}_SAVE")
    if not target:
        return
    count, _, suffix = target.partition(":")
    if suffix and not name.endswith(suffix):
        return
    _commits[moment] = _commits.get(moment, 0) + 1
    if _commits[moment] == int(count):
        print(f"@@stopped-{moment}-save {path}", flush=True)
        # to this thread (the background writer, maybe): it stops here, before its next instruction
        signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)


def hang(name: str, path: Any) -> None:
    target = os.environ.get("LIT_MINIMIND_TEST_HANG_IN_SAVE")
    if not target:
        return
    count, _, suffix = target.partition(":")
    if suffix and not name.endswith(suffix):
        return
    _commits["hang"] = _commits.get("hang", 0) + 1
    if _commits["hang"] == int(count):
        print(f"@@hanging-in-save {path}", flush=True)
        threading.Event().wait()  # this thread only: the others (the training loop, maybe) go on


def install() -> None:
    from lit_minimind.checkpoint.atomic import use_storage
    from tests.helpers.faulty_storage import FaultyStorage

    use_storage(FaultyStorage())


def wanted() -> bool:
    return any(k.startswith(("LIT_MINIMIND_TEST_FAIL", "LIT_MINIMIND_TEST_STOP_", "LIT_MINIMIND_TEST_HANG_"))
               for k in os.environ)
