"""Test-only: the writer's storage with the faults and pauses of :mod:`tests.helpers.faults` (installed by
its ``install()``, imported only then: the writer imports torch)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lit_minimind.checkpoint.atomic import LocalStorage
from lit_minimind.checkpoint.names import MANIFEST_SUFFIX
from tests.helpers.faults import fault, hang, pause

_renamed: set[str] = set()  # data files renamed into place, awaiting their directory fsync


def _data(tmp: Path, target: Path) -> str | None:
    """The checkpoint file a write commits (its name); None for a manifest or a file written without one."""
    if tmp.name.startswith(".") or target.name.endswith(MANIFEST_SUFFIX):
        return None  # atomic_open's shared tmp names (cache, log), or a manifest
    return target.name


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


class FaultyStorage(LocalStorage):
    """The writer's file operations with faults and pauses at a checkpoint's own files."""

    def open(self, tmp: Path, mode: str, target: Path) -> Any:
        if not tmp.name.startswith(".") and target.name.endswith(MANIFEST_SUFFIX):
            fault("manifest", target.name.removesuffix(MANIFEST_SUFFIX), tmp)
        f = super().open(tmp, mode, target)
        data = _data(tmp, target)
        return _FaultyFile(f, data) if data else f

    def sync(self, f: Any, target: Path) -> None:
        if data := _data(Path(f.name), target):
            fault("fsync", data, f.name)
        super().sync(f, target)

    def link(self, source: Path, tmp: Path, target: Path) -> None:
        if data := _data(tmp, target):
            fault("link", data, tmp)
        super().link(source, tmp, target)

    def replace(self, tmp: Path, target: Path) -> None:
        data = _data(tmp, target)
        if data:
            hang(data, tmp)
            pause("in", data, tmp)
            fault("rename", data, target)
        super().replace(tmp, target)
        if data:
            _renamed.add(os.path.abspath(target))

    def sync_dir(self, target: Path) -> None:
        key = os.path.abspath(target)
        if key in _renamed:
            fault("dirfsync", target.name, target)
        super().sync_dir(target)
        if key in _renamed:  # the commit of a data file is complete
            _renamed.discard(key)
            pause("after", target.name, target)
