"""Test-only: faults and pauses inside the project's atomic writer, from outside the package.

Installed in every process the tests start (``tests/helpers/site/sitecustomize.py``, on the
``PYTHONPATH`` of :func:`tests.conftest.cli_env`) when one of these variables is set:

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

It replaces, in :mod:`lit_minimind.checkpoint.atomic` only, the ``os`` module and ``open`` it calls
with wrappers that act on the checkpoint's own files (``NAME.tmp``, ``NAME.manifest.json.tmp``) and pass
everything else through.
"""

from __future__ import annotations

import builtins
import errno
import os
import signal
import threading
from pathlib import Path
from typing import Any

_faults_seen: dict[str, int] = {}
_commits: dict[str, int] = {}
_renamed: set[str] = set()  # data files renamed into place, awaiting their directory fsync


def _data_name(path: str | os.PathLike) -> str | None:
    """The checkpoint file a tmp path is the data of (``x.ckpt.tmp`` -> ``x.ckpt``); None otherwise."""
    name = Path(path).name
    if not name.endswith(".tmp") or name.endswith(".manifest.json.tmp") or name.startswith("."):
        return None  # not a checkpoint's data: a manifest, or an atomic_open file (cache, log)
    return name.removesuffix(".tmp")


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


class _FaultyFile:
    """A data tmp file whose first write may fail."""

    def __init__(self, f: Any, name: str) -> None:
        self._f, self._name, self._written = f, name, False

    def write(self, data: bytes) -> int:
        if not self._written:
            self._written = True
            fault("write", self._name, self._f.name)
        return self._f.write(data)

    def __enter__(self) -> _FaultyFile:
        self._f.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._f.__exit__(*exc)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._f, attr)


def _open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
    name = Path(file).name if isinstance(file, (str, os.PathLike)) else ""
    if name.endswith(".manifest.json.tmp"):
        fault("manifest", name.removesuffix(".manifest.json.tmp"), file)
    f = builtins.open(file, mode, *args, **kwargs)
    data = _data_name(file) if isinstance(file, (str, os.PathLike)) else None
    return _FaultyFile(f, data) if data and "w" in mode else f


class _Os:
    """``os`` for the atomic writer: faults and pauses at its file operations, the rest passed through."""

    def __getattr__(self, attr: str) -> Any:
        return getattr(os, attr)

    @staticmethod
    def fsync(fd: int) -> None:
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            path = ""
        if os.path.isdir(path):
            for name in [n for n in _renamed if os.path.dirname(n) == path]:
                fault("dirfsync", os.path.basename(name), name)
        elif data := _data_name(path):
            fault("fsync", data, path)
        os.fsync(fd)

    @staticmethod
    def replace(src: Any, dst: Any) -> None:
        data = _data_name(src)
        if data:
            hang(data, src)
            pause("in", data, src)
            fault("rename", data, dst)
        os.replace(src, dst)
        if data:
            _renamed.add(os.path.abspath(dst))

    @staticmethod
    def link(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        if data := _data_name(dst):
            fault("link", data, dst)
        os.link(src, dst, *args, **kwargs)


def install() -> None:
    from lit_minimind.checkpoint import atomic

    fsync_dir = atomic._fsync_dir

    def _fsync_dir(path: Path) -> None:
        fsync_dir(path)
        key = os.path.abspath(path)
        if key in _renamed:  # the commit of a data file is complete
            _renamed.discard(key)
            pause("after", Path(path).name, path)

    atomic.os = _Os()
    atomic.open = _open
    atomic._fsync_dir = _fsync_dir


def wanted() -> bool:
    return any(k.startswith(("LIT_MINIMIND_TEST_FAIL", "LIT_MINIMIND_TEST_STOP_", "LIT_MINIMIND_TEST_HANG_"))
               for k in os.environ)
