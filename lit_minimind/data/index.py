"""The record index of a jsonl data file: validated once, cached, memory-mapped by every start.

A data set needs the byte offset of each record and the certainty that every line is a valid
record of its kind. Reading a multi-GB file for that at every start (every resume, every rank)
costs minutes; :func:`record_offsets` does it once per file version and caches the result in
``<cache>/index/`` (``$LIT_MINIMIND_CACHE``, default ``~/.cache/lit_minimind``):

- ``<name>-<path hash>.npy``: the offsets, ``uint64``, 8 bytes per record;
- ``<name>-<path hash>.json``: what they describe: the file's absolute path, size, mtime (ns) and a
  hash of its first and last MiB, the validator that accepted every line, the record count and a
  CRC-32 of the offsets. The header exists only for a file whose every line passed validation.

Both are written with the project's atomic writer. A start whose file still matches the header
maps the ``.npy`` read-only (``np.load(mmap_mode="r")``): DataLoader workers and the ranks of a
node share its pages. Anything that does not match (a changed file, another validator, a
damaged, truncated or foreign index) is rebuilt, never trusted.

One build per machine (and per shared cache): the builder holds an exclusive ``flock`` on
``<name>-<path hash>.lock``; the other processes wait for it, then map what it wrote.

The scan: every line decoded (``orjson``, with the standard ``json`` module as the reference for
what it refuses: a line is bad only if ``json`` refuses it too; files over 64 MiB in byte ranges
cut at line ends, one forked process per core) and checked by the data kind's validator, a
``check(record, where)`` that raises :class:`DataError` naming ``where`` (``"<file>: line N"``,
1-based; blank lines count as lines, not as records). Any kind plugs in with its validator.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import sys
import time
from array import array
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from lit_minimind.checkpoint.atomic import Fingerprint, atomic_open, atomic_write_bytes
from lit_minimind.errors import DataError

try:  # a fast JSON decoder (a dependency); the standard module is the reference either way
    from orjson import loads as _fast_loads
except ImportError:  # pragma: no cover - orjson is a dependency
    _fast_loads = json.loads

__all__ = ["RecordCheck", "record_offsets", "index_paths", "validator_name", "scan_offsets", "parse_record",
           "require_file", "json_type"]

RecordCheck = Callable[[dict, str], None]
INDEX_FORMAT = "lit-minimind-jsonl-index"
INDEX_VERSION = 1
ENDS_BYTES = 1 << 20  # the head and the tail hashed into the key
_WHERE = "\x00where\x00"  # stands for "<file>: line N" while a line passes (the message is built on failure only)


def record_offsets(path: str | os.PathLike[str], check: RecordCheck, cache_dir: str | os.PathLike[str] | None = None) -> np.ndarray:
    """The byte offset of each record of the jsonl file ``path``, every line validated by ``check``.

    Returns a read-only ``uint64`` array, memory-mapped from the cached index (built first, under
    the lock, when missing or stale); an in-memory one when the cache cannot be written. Raises
    :class:`DataError` for a missing file, a directory, a file without records, or the first bad
    line (file and 1-based line number).
    """
    path = require_file(path).resolve()
    npy, header_path, lock = index_paths(path, cache_dir)
    offsets = _load(npy, header_path, _key(path, check))
    if offsets is not None:
        return offsets
    try:
        npy.parent.mkdir(parents=True, exist_ok=True)
        held = _lock(lock, path)
    except OSError as err:  # a cache that cannot be written: validate, keep nothing
        _say(f"cannot use the index cache {npy.parent} ({err.strerror or err}): scanning {path} at every start")
        return _build(path, check)[0]
    with held:
        key = _key(path, check)  # the file as it is now, under the lock
        offsets = _load(npy, header_path, key)  # another process may have built it while this one waited
        if offsets is not None:
            return offsets
        offsets, lines, seconds = _build(path, check)
        try:
            _write(npy, header_path, key, offsets, lines)
        except OSError as err:
            _say(f"cannot write the index {npy} ({err.strerror or err}): scanning {path} at every start")
            return offsets
        _say(f"indexed {path}: {len(offsets):,} records, {lines:,} lines, every line valid, in {seconds:.2f} s "
             f"(cached in {npy}, {npy.stat().st_size:,} bytes)")
        _prune(npy.parent)
        loaded = _load(npy, header_path, key)
        return loaded if loaded is not None else offsets


def require_file(path: str | os.PathLike[str]) -> Path:
    """``path`` as a Path; DataError naming it when it does not exist or is a directory."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: data file does not exist")
    if path.is_dir():
        raise DataError(f"{path}: is a directory, expected a jsonl file")
    return path


def build_workers(size: int) -> int:
    """Processes for the scan of a file of ``size`` bytes: one per available core (at most 8) for
    files over 64 MiB (a fork costs ~10 ms; each range is 32 MiB or more), else 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, 8, size // (32 << 20))) if size > (64 << 20) and sys.platform == "linux" else 1


def _say(message: str) -> None:
    print(f"lit_minimind: {message}", file=sys.stderr, flush=True)


def index_paths(path: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None) -> tuple[Path, Path, Path]:
    """``(offsets.npy, header.json, lock)`` of the index of the data file ``path``."""
    if cache_dir is None:
        from lit_minimind.data.tokenizer import default_cache_dir

        cache_dir = default_cache_dir()
    path = Path(path).resolve()
    stem = f"{path.name}-{hashlib.sha256(str(path).encode()).hexdigest()[:16]}"
    directory = Path(cache_dir) / "index"
    return directory / f"{stem}.npy", directory / f"{stem}.json", directory / f"{stem}.lock"


def validator_name(check: RecordCheck) -> str:
    """The name a validator is known by in an index header (its module and qualified name, and its
    ``rules_version`` when it has one: bump it when the rules change)."""
    name = f"{getattr(check, '__module__', '?')}.{getattr(check, '__qualname__', repr(check))}"
    version = getattr(check, "rules_version", None)
    return f"{name}:v{version}" if version is not None else name


def scan_offsets(path: Path, check: RecordCheck, workers: int = 1) -> tuple[np.ndarray, int]:
    """Validate every line of ``path``; ``(offsets of the records (uint64), number of lines)``.

    ``workers`` > 1 scans that many byte ranges (cut at line ends) in forked processes at once.
    Raises :class:`DataError` naming the file and the 1-based line number of the first bad line.
    """
    size = path.stat().st_size
    if workers > 1 and not _picklable(check):  # a lambda or a closure cannot reach a worker
        workers = 1
    ranges = _byte_ranges(path, size, workers) if workers > 1 else [(0, size)]
    jobs = [(path, start, end, check) for start, end in ranges]
    parts = _scan_in_processes(jobs) if len(jobs) > 1 else [_scan_range(job) for job in jobs]
    lines = 0
    for _, count, bad in parts:
        if bad is not None:  # the first bad line of the first range that has one: the file's first
            with open(path, "rb") as file:
                file.seek(bad[1])
                _slow_check(path, file.readline(), lines + bad[0], check)
            raise DataError(f"{path}: line {lines + bad[0]}: rejected by {validator_name(check)}")
        lines += count
    offsets = np.concatenate([part[0] for part in parts]) if len(parts) > 1 else parts[0][0]
    offsets.flags.writeable = False
    if not len(offsets):
        raise DataError(f"{path}: no records (the file is empty or has only blank lines)")
    return offsets, lines


def _scan_in_processes(jobs: list[tuple[Path, int, int, RecordCheck]]) -> list[tuple[np.ndarray, int, tuple[int, int] | None]]:
    """Each job scanned in a forked process of its own, which ignores stop signals (the main process owns the
    stop, as with DataLoader workers: a group's SIGTERM must not kill a scan half-way). Written by hand, not
    with ``multiprocessing.Pool``: a pool ends its workers with SIGTERM, which such workers ignore (its exit
    then waits forever), and a worker that dies loses its task without a word. Here a dead worker is an error
    naming its range, and any way out kills what is left."""
    import multiprocessing
    from multiprocessing.connection import wait

    ctx = multiprocessing.get_context("fork")
    pipes = [ctx.Pipe(duplex=False) for _ in jobs]
    procs = [ctx.Process(target=_scan_worker, args=(job, send), daemon=True) for job, (_, send) in zip(jobs, pipes)]
    parts: dict[int, tuple[np.ndarray, int, tuple[int, int] | None]] = {}
    try:
        for proc in procs:
            proc.start()
        for _, send in pipes:
            send.close()  # this process's copy: a dead worker's pipe then reads EOF
        waiting = {recv: k for k, (recv, _) in enumerate(pipes)}
        while waiting:
            for recv in wait(list(waiting)):
                k = waiting.pop(recv)
                try:
                    parts[k] = recv.recv()
                except EOFError:
                    path, start, end, _ = jobs[k]
                    procs[k].join()
                    raise DataError(f"{path}: the process indexing bytes {start}-{end} died (exit "
                                    f"{procs[k].exitcode}); run again") from None
        for proc in procs:
            proc.join()
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
    return [parts[k] for k in range(len(jobs))]


def _scan_worker(job: tuple[Path, int, int, RecordCheck], send: Any) -> None:
    from lit_minimind.data.workers import ignore_stop_signals

    ignore_stop_signals(0)
    send.send(_scan_range(job))
    send.close()


def _picklable(check: RecordCheck) -> bool:
    import pickle

    try:
        pickle.dumps(check)
    except Exception:
        return False
    return True


def _byte_ranges(path: Path, size: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` byte ranges covering the file, each ending at a line end."""
    bounds = [0]
    with open(path, "rb") as file:
        for k in range(1, parts):
            file.seek(max(size * k // parts - 1, bounds[-1]))
            file.readline()
            bounds.append(min(max(file.tell(), bounds[-1]), size))
    bounds.append(size)
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a] or [(0, 0)]


def _scan_range(job: tuple[Path, int, int, RecordCheck]) -> tuple[np.ndarray, int, tuple[int, int] | None]:
    """Scan the lines of one byte range: ``(record offsets, lines, (line in range, offset) of the
    first bad line or None)``."""
    path, position, end, check = job
    offsets = array("Q")
    append = offsets.append
    lineno = 0
    with open(path, "rb") as file:
        file.seek(position)
        while position < end:
            line = file.readline()
            if not line:
                break
            lineno += 1
            try:
                record = _fast_loads(line)
                if type(record) is not dict:
                    raise TypeError
                check(record, _WHERE)
            except Exception:
                try:
                    if _slow_check(path, line, lineno, check) is None:  # a blank line
                        position += len(line)
                        continue
                except DataError:
                    return np.frombuffer(offsets, dtype=np.uint64), lineno, (lineno, position)
            append(position)
            position += len(line)
    return np.frombuffer(offsets, dtype=np.uint64), lineno, None


def _slow_check(path: Path, line: bytes, lineno: int, check: RecordCheck) -> dict | None:
    """A line the fast path refused: ``None`` if blank, the record if the reference parser and the
    validator accept it, else the DataError naming the line."""
    if line.isspace():
        return None
    where = f"{path}: line {lineno}"
    record = parse_record(line, where)
    check(record, where)
    return record


def parse_record(line: bytes, where: str) -> dict:
    """Decode one jsonl line that must hold a JSON object; DataError naming ``where`` if not. The line's end is not
    part of the JSON: a string left open says "Unterminated string", not "Invalid control character" (the newline)."""
    try:
        record = json.loads(line.rstrip(b"\r\n"))
    except UnicodeDecodeError as exc:
        raise DataError(f"{where}: not valid UTF-8 ({exc.reason} at byte {exc.start})") from exc
    except json.JSONDecodeError as exc:
        raise DataError(f"{where}: not valid JSON ({exc.msg.removesuffix(' at')} at column {exc.colno})") from exc  # json's own "... at"
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {json_type(record)}")
    return record


def json_type(value: object) -> str:
    """JSON name of a decoded value's type, for error messages."""
    names = {
        dict: "object", list: "array", str: "string", bool: "boolean",
        int: "number", float: "number", type(None): "null",
    }
    return names.get(type(value), type(value).__name__)


# ----------------------------------------------------------------------------- cache


def _key(path: Path, check: RecordCheck) -> dict[str, Any]:
    """What an index must match: the file (path, size, mtime, head and tail) and the validator."""
    stat = path.stat()
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as file:
        digest.update(file.read(ENDS_BYTES))
        if stat.st_size > ENDS_BYTES:
            file.seek(max(ENDS_BYTES, stat.st_size - ENDS_BYTES))
            digest.update(file.read(ENDS_BYTES))
    return {"path": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
            "ends_blake2b": digest.hexdigest(), "validator": validator_name(check)}


def _load(npy: Path, header_path: Path, key: dict[str, Any]) -> np.ndarray | None:
    """The cached offsets if the header matches ``key`` and the array its record count and CRC; else None."""
    try:
        header = json.loads(header_path.read_bytes())
    except (OSError, ValueError):
        return None
    if not isinstance(header, dict) or header.get("format") != INDEX_FORMAT or header.get("version") != INDEX_VERSION:
        return None
    if header.get("key") != key:
        return None
    try:
        offsets = np.load(npy, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError):
        return None
    if offsets.dtype != np.uint64 or offsets.ndim != 1 or len(offsets) != header.get("records") or not len(offsets):
        return None
    if Fingerprint.of([memoryview(offsets).cast("B")]).crc32 != header.get("offsets_crc32"):
        return None
    return offsets


def _build(path: Path, check: RecordCheck) -> tuple[np.ndarray, int, float]:
    start = time.perf_counter()
    offsets, lines = scan_offsets(path, check, build_workers(path.stat().st_size))
    return offsets, lines, time.perf_counter() - start


def _write(npy: Path, header_path: Path, key: dict[str, Any], offsets: np.ndarray, lines: int) -> None:
    """The offsets, then the header that vouches for them (both atomic; a reader that sees a new
    header with an old array finds the CRC wrong and takes the lock)."""
    with atomic_open(npy, "wb") as file:
        np.save(file, offsets, allow_pickle=False)
    header = {"format": INDEX_FORMAT, "version": INDEX_VERSION, "key": key, "records": len(offsets),
              "lines": lines, "validated": True, "offsets_crc32": Fingerprint.of([offsets.data]).crc32,
              "built_by": {"pid": os.getpid(), "host": os.uname().nodename}, "built_at": time.time()}
    atomic_write_bytes(json.dumps(header, indent=1) + "\n", header_path)


def _prune(directory: Path) -> None:
    """Remove the index files of data files that no longer exist (temporary files, moved data);
    each lock file holds the path of its data file."""
    for lock in directory.glob("*.lock"):
        try:
            data = lock.read_text(encoding="utf-8")
        except (OSError, ValueError):
            continue
        if not data or Path(data).exists():
            continue  # not ours, or a file still there
        for suffix in (".npy", ".json", ".lock"):
            lock.with_suffix(suffix).unlink(missing_ok=True)


@contextlib.contextmanager
def _locked(fd: int) -> Iterator[None]:
    try:
        yield
    finally:
        os.close(fd)  # releases the flock


def _lock(lock: Path, path: Path) -> contextlib.AbstractContextManager[None]:
    """Hold the exclusive build lock of ``path``'s index (wait for another builder)."""
    import fcntl

    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if not os.fstat(fd).st_size:  # the data file it serves, for _prune
            os.write(fd, str(path).encode())
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say(f"waiting for another process to index {path}")
            fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError as err:
        if isinstance(err, BlockingIOError) or err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP):
            os.close(fd)
            raise
        # a filesystem without flock: each process builds (the writes stay atomic)
    except BaseException:
        os.close(fd)
        raise
    return _locked(fd)
