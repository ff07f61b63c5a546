"""The one atomic writer, and the one storage interface a run's checkpoint files are kept through.

Every file this project writes goes through :func:`atomic_save`, :func:`atomic_link`, :func:`atomic_receive`,
:func:`atomic_open` or :func:`atomic_directory`. Order: data to a tmp file in the same directory (fsync), manifest
``<file>.manifest.json`` with size and CRC-32 (fsync, atomic), ``os.replace`` of the data, fsync of the directory.
A reader can then tell a complete file from a torn or corrupted one (:mod:`lit_minimind.checkpoint.read`). The
file operations an atomic write is made of are :class:`FileOps`, passed to each writer (``ops``).

:class:`Storage` is where a run's checkpoint files are kept: ``list`` / ``commit`` / ``read`` / ``remove`` of
committed files by name. :class:`LocalDir` is a local directory (its :class:`FileOps` passed in);
:class:`lit_minimind.checkpoint.remote.RemoteDir` an object store. Retention (:func:`retain`, :func:`retain_runs`)
is written once, over that interface.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
import time
import zlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, BinaryIO, Protocol

import torch

from lit_minimind.checkpoint.names import CheckpointName, expired, manifest_path
from lit_minimind.errors import CheckpointError


@dataclass(frozen=True)
class Fingerprint:
    """What identifies a file's bytes: size and CRC-32 (``%08x``), as every manifest records them.

    CRC-32 (zlib, ~7 GB/s here) rather than sha256 (~2 GB/s): it detects truncation and bit rot,
    which is its job here, at a quarter of the cost on the training thread.
    """

    size: int
    crc32: str

    @classmethod
    def of(cls, chunks: Iterable[bytes]) -> Fingerprint:
        """The fingerprint of a stream of bytes."""
        crc, size = 0, 0
        for chunk in chunks:
            crc, size = zlib.crc32(chunk, crc), size + len(chunk)
        return cls(size, f"{crc:08x}")

    @classmethod
    def of_file(cls, path: str | os.PathLike) -> Fingerprint:
        return cls.of(file_chunks(path))

    @classmethod
    def recorded(cls, manifest: Mapping[str, Any], key: str | None = None) -> Fingerprint | None:
        """The fingerprint a manifest records (``key="replaces"``: of the file its save replaced); None without one."""
        fields = manifest.get(key) if key else manifest
        if not isinstance(fields, Mapping) or "size" not in fields or "crc32" not in fields:
            return None
        return cls(int(fields["size"]), str(fields["crc32"]))

    def fields(self) -> dict[str, Any]:
        return {"size": self.size, "crc32": self.crc32}

    def describe(self) -> str:
        return f"{self.size} bytes, CRC-32 {self.crc32}"


CHUNK = 1 << 22  # bytes per read when checksumming a file


def file_chunks(path: str | os.PathLike) -> Iterator[bytes]:
    """A file's bytes in ``CHUNK``-sized pieces."""
    with open(path, "rb") as f:
        yield from iter(lambda: f.read(CHUNK), b"")


class _HashingWriter:
    """File wrapper that checksums what ``torch.save`` writes, so no second read is needed."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self.crc32 = 0
        self.size = 0
        self.error: OSError | None = None  # torch's zip writer hides it behind a RuntimeError

    def write(self, data: bytes) -> int:
        self.crc32 = zlib.crc32(data, self.crc32)
        self.size += len(data)
        try:
            return self._f.write(data)
        except OSError as err:
            self.error = err
            raise

    def flush(self) -> None:
        self._f.flush()

    @property
    def fingerprint(self) -> Fingerprint:
        return Fingerprint(self.size, f"{self.crc32:08x}")


class FileOps:
    """The file operations every atomic write is made of, the one place they are called; each is told the
    file it commits (``target``: the data file, or its manifest). Passed to the writers (``ops``); the tests'
    implementation injects faults and pauses (``tests/helpers/faulty_storage.py``)."""

    def open(self, tmp: Path, mode: str, target: Path) -> IO[Any]:
        return open(tmp, mode, **({} if "b" in mode else {"encoding": "utf-8", "newline": "\n"}))

    def sync(self, f: IO[Any], target: Path) -> None:
        f.flush()
        os.fsync(f.fileno())

    def link(self, source: Path, tmp: Path, target: Path) -> None:
        link_or_copy(source, tmp)

    def replace(self, tmp: Path, target: Path) -> None:
        os.replace(tmp, target)

    def sync_dir(self, target: Path) -> None:
        """Make the rename of ``target`` durable: fsync its directory. Filesystems that cannot fsync a
        directory are skipped; a real I/O error (EIO, ENOSPC) is raised."""
        try:
            fd = os.open(target.parent, os.O_RDONLY)
        except OSError:  # not supported everywhere (e.g. some network filesystems)
            return
        try:
            os.fsync(fd)
        except OSError as err:
            if err.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
                raise
        finally:
            os.close(fd)


def file_ops(ops: FileOps | None) -> FileOps:
    """``ops``, or the plain file operations."""
    return ops if ops is not None else FileOps()


def tmp_for(path: Path, shared: bool = False) -> Path:
    """The temporary name a write of ``path`` goes to first: ``{name}.tmp`` beside it (a killed write's is
    replaced by the next one), or ``.{name}.{pid}.tmp`` where processes may write ``path`` at once (``shared``)."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp" if shared else f"{path.name}.tmp")


@contextlib.contextmanager
def _staged(ops: FileOps, path: Path, shared: bool = False) -> Iterator[Path]:
    """The one commit skeleton: yields the tmp path to fill (and sync); then the rename onto ``path`` and the
    directory's fsync. Any error, or a kill, leaves ``path`` as it was and removes the tmp file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_for(path, shared)
    tmp.unlink(missing_ok=True)
    try:
        yield tmp
        ops.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    ops.sync_dir(path)


@contextlib.contextmanager
def _write(ops: FileOps, tmp: Path, mode: str, target: Path) -> Iterator[IO[Any]]:
    """``tmp`` open for writing ``target``'s bytes, synced to disk when the block ends."""
    with ops.open(tmp, mode, target) as f:
        yield f
        ops.sync(f, target)


def link_or_copy(source: Path, target: Path) -> None:
    """``target`` the same file as ``source``: a hard link (no bytes written), a copy (fsynced) where the
    filesystem has none (EPERM, EXDEV, ENOTSUP, EMLINK); any other error is raised."""
    try:
        os.link(source, target)
    except OSError as err:
        if err.errno not in (errno.EPERM, errno.EXDEV, errno.ENOTSUP, errno.EMLINK):
            raise
        shutil.copyfile(source, target)
        with open(target, "rb+") as f:
            os.fsync(f.fileno())


def atomic_save(obj: Any, path: str | os.PathLike, meta: Mapping[str, Any] | None = None,
                ops: FileOps | None = None) -> dict[str, Any]:
    """The one writer: ``torch.save`` to ``path`` atomically, with a manifest (size, CRC-32) beside it.

    Order: data to a tmp file (fsync), manifest (fsync, atomic), ``os.replace`` of the data, fsync
    of the directory. The manifest also lists the file it replaces, so at every moment the file
    on disk - old or new - matches its manifest. Any failure (ENOSPC, EFBIG, EACCES, a kill)
    leaves the previous file intact, at most with a ``.tmp`` beside it. Returns the manifest.
    """
    path, ops = Path(path), file_ops(ops)
    with _staged(ops, path) as tmp:
        with _write(ops, tmp, "wb", path) as f:
            writer = _HashingWriter(f)
            try:
                torch.save(obj, writer)
            except RuntimeError:
                if writer.error is not None:
                    raise writer.error from None  # the real cause: ENOSPC, EFBIG, EIO, ...
                raise
        return _write_manifest(ops, path, {**writer.fingerprint.fields(), **(meta or {})})


def atomic_link(source: str | os.PathLike, path: str | os.PathLike, ops: FileOps | None = None) -> dict[str, Any]:
    """Make ``path`` the same file as ``source`` (:func:`link_or_copy`), atomically, with ``source``'s manifest."""
    source, path, ops = Path(source), Path(path), file_ops(ops)
    with _staged(ops, path) as tmp:
        ops.link(source, tmp, path)
        return _write_manifest(ops, path, _carried(read_manifest(source)))


def atomic_receive(chunks: Iterable[bytes], path: str | os.PathLike, manifest: Mapping[str, Any],
                   ops: FileOps | None = None) -> dict[str, Any]:
    """Write a file received in ``chunks`` (a download) atomically, with ``manifest`` beside it, checking
    size and CRC-32 while the bytes arrive: a mismatch raises :class:`CheckpointError` and leaves nothing."""
    path, ops = Path(path), file_ops(ops)
    with _staged(ops, path) as tmp:
        with _write(ops, tmp, "wb", path) as f:
            received = Fingerprint.of(_written(f, chunks))
        expected = Fingerprint.recorded(manifest)
        if received != expected:
            raise CheckpointError(f"{path.name}: received {received.describe()}, its manifest says "
                                  f"{expected.describe() if expected else 'nothing'} (damaged or replaced)")
        return _write_manifest(ops, path, _carried(manifest))


def _written(f: BinaryIO, chunks: Iterable[bytes]) -> Iterator[bytes]:
    for chunk in chunks:
        f.write(chunk)
        yield chunk


def _carried(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """A manifest's fields that describe the bytes and the save (not which file it was, nor what it replaced)."""
    return {k: v for k, v in manifest.items() if k not in ("file", "replaces")}


def _write_manifest(ops: FileOps, path: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """``path``'s manifest, committed before its data is renamed into place: it lists the file it replaces,
    so the file on disk, old or new, matches its manifest at every moment."""
    previous = Fingerprint.recorded(read_manifest(path)) if path.exists() else None
    manifest = {"file": path.name, **manifest, "saved_at": manifest.get("saved_at") or time.time_ns()}
    if previous is not None:
        manifest["replaces"] = previous.fields()
    target = manifest_path(path)
    with _staged(ops, target) as tmp, _write(ops, tmp, "w", target) as f:
        json.dump(manifest, f, indent=1)
    return manifest


def remove_file(path: str | os.PathLike) -> None:
    """Removal (retention, a run's old files): its manifest first, then the data, as on a bucket. A kill in
    between leaves a complete file without a manifest: still whole (its zip records' CRCs verify it), never a
    torn one."""
    for p in (manifest_path(path), Path(path)):
        p.unlink(missing_ok=True)


_manifests: dict[str, tuple[tuple[int, int, int], dict[str, Any]]] = {}


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The manifest saved beside ``path`` ({} when absent or unreadable); each version of a manifest
    file is read once per process (sorting candidates, verifying, starting)."""
    mpath = manifest_path(path)
    try:
        st = mpath.stat()
        version = (st.st_ino, st.st_size, st.st_mtime_ns)
        cached = _manifests.get(str(mpath))
        if cached is not None and cached[0] == version:
            return dict(cached[1])
        manifest = json.loads(mpath.read_text())
    except (OSError, ValueError):
        return {}
    _manifests[str(mpath)] = (version, manifest)
    return dict(manifest)


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", ops: FileOps | None = None) -> Iterator[IO[Any]]:
    """Write a file (``mode`` "w" or "wb") atomically, without a manifest: a tmp file beside it, fsync,
    rename, directory fsync. Caches, logs, generated data and benchmark results; on any error the
    previous file stays and no tmp file is left."""
    ops = file_ops(ops)
    with _staged(ops, Path(path), shared=True) as tmp, _write(ops, tmp, mode, Path(path)) as f:
        yield f


def atomic_write_bytes(data: bytes | str, path: str | os.PathLike) -> Path:
    """:func:`atomic_open` for content already in memory (``str`` is written as UTF-8)."""
    with atomic_open(path, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
    return Path(path)


def default_mode(directory: bool = False) -> int:
    """The mode ``open`` (0o666) or ``mkdir`` (0o777) gives a new file here: less the process's umask
    (0o644 / 0o755 under umask 022). Read from /proc where it can be: ``os.umask`` must set it to read it."""
    try:
        with open("/proc/self/status") as f:
            mask = next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        mask = os.umask(0o022)
        os.umask(mask)
    return (0o777 if directory else 0o666) & ~mask


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike, replace: bool = False, ops: FileOps | None = None) -> Iterator[Path]:
    """Write a directory atomically: yields an empty tmp directory beside ``path``
    (``{name}.*.tmp``); when the block ends without an error, every file in it is fsynced and it is
    renamed to ``path`` (parent directory fsynced). An error removes it; a kill leaves no ``path``
    (at most the tmp directory).

    An existing empty ``path`` is replaced; a non-empty one only with ``replace``: it is renamed aside
    first (``.{name}.*.old``, removed afterwards), so ``path`` is the old or the new directory at every
    moment but the one between the two renames. Every file and directory in it gets the umask's
    default mode (:func:`default_mode`), whatever mode the library that wrote it chose (safetensors: 0o600).
    """
    path, ops = Path(path), file_ops(ops)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f"{path.name}.", suffix=".tmp"))
    try:
        yield tmp
        for file in [*tmp.rglob("*"), tmp]:  # the files' bytes, then the directory's entries
            file.chmod(default_mode(file.is_dir()))  # mkdtemp's and safetensors' private modes: an export is for others
            fd = os.open(file, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        old = None
        if path.is_dir() and any(path.iterdir()):
            if not replace:
                raise FileExistsError(errno.EEXIST, "directory exists and is not empty", str(path))
            old = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".old"))
            os.replace(path, old)  # onto the empty directory just made
        elif path.is_dir():
            path.rmdir()
        try:
            ops.replace(tmp, path)
        except BaseException:
            if old is not None:
                os.replace(old, path)
            raise
        ops.sync_dir(path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# ----------------------------------------------------------------------------- where a run's files are kept

def save_order_key(path: Path) -> tuple[int, bool]:
    """When a local file was saved (its manifest's time, else its mtime); on a tie a Lightning ``.ckpt`` first."""
    saved_at = read_manifest(path).get("saved_at")
    if saved_at is None:
        saved_at = path.stat().st_mtime_ns if path.exists() else 0
    return int(saved_at), path.suffix == ".ckpt"


class Storage(Protocol):
    """Where a run's checkpoint files are kept, by name: a local directory (:class:`LocalDir`) or an object store
    (:class:`lit_minimind.checkpoint.remote.RemoteDir`). A file is committed whole or not at all."""

    def where(self, name: str) -> str:
        """``name`` as a user reads it (a path, a URL)."""

    def list(self, pattern: str) -> list[tuple[str, dict[str, Any]]]:
        """``(name, manifest)`` of the files matching the glob ``pattern``, newest save first."""

    def commit(self, name: str, source: Path, manifest: Mapping[str, Any]) -> None:
        """``name`` made to hold the complete local file ``source`` (whose manifest is ``manifest``)."""

    def read(self, name: str) -> Iterator[bytes]:
        """The bytes of ``name``, in chunks."""

    def remove(self, name: str) -> None:
        """``name`` removed: its manifest first (no longer a candidate), then its data."""


class LocalDir:
    """A local directory as a :class:`Storage`; its writes go through ``ops``."""

    def __init__(self, root: str | os.PathLike, ops: FileOps | None = None) -> None:
        self.root, self.ops = Path(root), file_ops(ops)

    def path(self, name: str) -> Path:
        return self.root / name

    def where(self, name: str) -> str:
        return str(self.path(name))

    def list(self, pattern: str) -> list[tuple[str, dict[str, Any]]]:
        """Every file matching ``pattern`` (with its manifest, ``{}`` without one: MiniMind's own files), newest first."""
        paths = sorted((p for p in self.root.glob(pattern) if p.is_file()), key=save_order_key, reverse=True)
        return [(p.name, read_manifest(p)) for p in paths]

    def save(self, obj: Any, name: str, meta: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """``torch.save`` of ``obj`` as ``name`` (:func:`atomic_save`)."""
        return atomic_save(obj, self.path(name), meta, self.ops)

    def commit(self, name: str, source: Path, manifest: Mapping[str, Any] | None = None) -> None:
        """``name`` the same file as ``source``, with its manifest (:func:`atomic_link`: no bytes copied)."""
        atomic_link(source, self.path(name), self.ops)

    def read(self, name: str) -> Iterator[bytes]:
        return file_chunks(self.path(name))

    def remove(self, name: str) -> None:
        remove_file(self.path(name))


def _runs(storage: Storage, pattern: str) -> list[tuple[str, str, int]]:
    """``(name, run id, -age rank)`` of our checkpoints matching ``pattern``, newest first; a checkpoint's run id is
    its manifest's, else the one in its name."""
    found = []
    for rank, (name, manifest) in enumerate(storage.list(pattern)):
        parsed = CheckpointName.parse(name)
        if parsed is not None:
            found.append((name, str(manifest.get("run_id") or parsed.run_id), -rank))
    return found


def retain(storage: Storage, pattern: str, run_id: str, keep_last: int) -> list[str]:
    """Retention, local and remote alike: run ``run_id``'s checkpoints beyond its newest ``keep_last`` removed
    (:func:`lit_minimind.checkpoint.names.expired`: another run's are never touched). Returns what was removed."""
    removed = expired(_runs(storage, pattern), run_id, keep_last)
    for name in removed:
        storage.remove(name)
    return removed


def retain_runs(storage: Storage, pattern: str, run_id: str, keep_runs: int) -> dict[str, list[str]]:
    """Every checkpoint of the runs older than the newest ``keep_runs`` removed (a run's age: its newest save;
    ``run_id``'s never). Returns the removed names by run."""
    runs: dict[str, list[str]] = {}
    for name, run, _ in _runs(storage, pattern):  # newest first: a run's first appearance is its newest save
        runs.setdefault(run, []).append(name)
    kept = [run_id, *[r for r in runs if r != run_id]][:keep_runs]
    removed = {run: names for run, names in runs.items() if run not in kept}
    for names in removed.values():
        for name in names:
            storage.remove(name)
    return removed
