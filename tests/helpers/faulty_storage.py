"""Test-only: the writer's storage with the faults and pauses of :mod:`tests.helpers.faults` (installed by
its ``install()``, imported only then: the writer imports torch)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lit_minimind.checkpoint.atomic import FileOps
from lit_minimind.checkpoint.names import MANIFEST_SUFFIX
from tests.helpers.faults import fault, hang, kind_of, pause

_renamed: dict[str, str] = {}  # data files renamed into place, awaiting their directory fsync: their kind


def _data(tmp: Path, target: Path) -> str | None:
    """What a write commits (:func:`tests.helpers.faults.kind_of`); None for a manifest or a file written without
    one."""
    if tmp.name.startswith(".") or target.name.endswith(MANIFEST_SUFFIX):
        return None  # atomic_open's shared tmp names (cache, log), or a manifest
    return kind_of(target.name, tmp.is_dir())


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


class FaultyFileOps(FileOps):
    """The writer's file operations with faults and pauses at a checkpoint's own files."""

    def open(self, tmp: Path, mode: str, target: Path) -> Any:
        if not tmp.name.startswith(".") and target.name.endswith(MANIFEST_SUFFIX):
            fault("manifest", kind_of(target.name.removesuffix(MANIFEST_SUFFIX)), tmp)
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
            _renamed[os.path.abspath(target)] = data

    def sync_dir(self, target: Path) -> None:
        kind = _renamed.get(os.path.abspath(target))
        if kind:
            fault("dirfsync", kind, target)
        super().sync_dir(target)
        if kind:  # the commit of a data file is complete
            del _renamed[os.path.abspath(target)]
            pause("after", kind, target)
