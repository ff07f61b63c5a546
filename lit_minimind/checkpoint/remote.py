"""Checkpoint directories on object storage: fsspec URLs (``s3://bucket/prefix``, ``gs://``, ``file://``, ...).

An object store has no rename, fsync or hard link; the same guarantees come from order. A file is
uploaded as its data object ``{dir}/{name}``, verified on the remote (size, and its CRC-32 read back),
and only then committed by its manifest object ``{dir}/{name}.manifest.json`` (the local manifest's
fields: size, CRC-32, epoch, step, run id, save time). A reader trusts manifests only and checks the
CRC-32 while downloading (:func:`lit_minimind.checkpoint.atomic.atomic_receive`); retention deletes a
manifest before its data, so a half-deleted checkpoint is never a candidate. Credentials come from
the backend's own environment and configuration (``AWS_*``, ``AWS_ENDPOINT_URL``); nothing here
stores, prints or logs them. :class:`RemoteDir` is a :class:`lit_minimind.checkpoint.atomic.Storage`, as a local
directory is: its retention is :func:`lit_minimind.checkpoint.atomic.retain`.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lit_minimind.checkpoint.atomic import Fingerprint, atomic_receive
from lit_minimind.checkpoint.names import MANIFEST_SUFFIX
from lit_minimind.errors import CheckpointError, UsageError

# what to install for a scheme whose fsspec backend is missing
_EXTRAS = {"s3": "pip install 'lit-minimind[s3]'", "s3a": "pip install 'lit-minimind[s3]'",
           "gs": "pip install gcsfs", "gcs": "pip install gcsfs",
           "az": "pip install adlfs", "abfs": "pip install adlfs", "abfss": "pip install adlfs"}
CHUNK = 8 << 20  # bytes per read/write of a transfer


class RemoteDir:
    """One checkpoint directory on object storage (any fsspec backend): a
    :class:`lit_minimind.checkpoint.atomic.Storage` (``list`` / ``commit`` / ``read`` / ``remove``)."""

    def __init__(self, url: str, flag: str = "directory") -> None:
        import fsspec

        self.url = url.rstrip("/")
        scheme = self.url.split("://", 1)[0].lower()
        # s3: no cached instance or listing (another process changes the bucket), bounded waits
        options: dict[str, Any] = {"skip_instance_cache": True}
        if scheme in ("s3", "s3a"):
            options.update(use_listings_cache=False,
                           config_kwargs={"connect_timeout": 5, "read_timeout": 60, "retries": {"max_attempts": 2}})
        try:
            self.fs, self.root = fsspec.core.url_to_fs(self.url, **options)
        except ImportError:
            raise UsageError(f"{flag} {url}: the {scheme}:// backend is not installed: "
                             f"{_EXTRAS.get(scheme, 'install the fsspec backend for ' + scheme + '://')}") from None
        except ValueError as err:
            raise UsageError(f"{flag} {url}: {str(err).splitlines()[0]}") from None
        self.root = self.root.rstrip("/")
        protocols = self.fs.protocol if isinstance(self.fs.protocol, (tuple, list)) else (self.fs.protocol,)
        self._has_directories = "file" in protocols or "local" in protocols  # object stores have none to make

    def path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def where(self, name: str) -> str:
        return f"{self.url}/{name}"

    # ------------------------------------------------------------------ reading
    def manifest(self, name: str) -> dict[str, Any] | None:
        """The committed manifest of ``name`` (None: not committed, or unreadable)."""
        try:
            return json.loads(self.fs.cat_file(self.path(name + MANIFEST_SUFFIX)))
        except FileNotFoundError:
            return None
        except ValueError:
            return None

    def list(self, pattern: str) -> list[tuple[str, dict[str, Any]]]:
        """``(name, manifest)`` of every committed file matching ``pattern``, newest save first."""
        self.fs.invalidate_cache()
        found = []
        for path in self.fs.glob(self.path(pattern + MANIFEST_SUFFIX)):
            name = path.rsplit("/", 1)[-1].removesuffix(MANIFEST_SUFFIX)
            manifest = self.manifest(name)
            if manifest is not None and Fingerprint.recorded(manifest) is not None:
                found.append((name, manifest))
        return sorted(found, key=lambda item: int(item[1].get("saved_at") or 0), reverse=True)

    def read(self, name: str) -> Iterator[bytes]:
        with self.fs.open(self.path(name), "rb", block_size=CHUNK) as f:
            while chunk := f.read(CHUNK):
                yield chunk

    def download(self, name: str, manifest: dict[str, Any], local: str | Path) -> dict[str, Any]:
        """``name`` to the local file ``local`` (atomic, with ``manifest``), its CRC-32 checked while streaming."""
        try:
            return atomic_receive(self.read(name), local, manifest)
        except CheckpointError as err:
            raise CheckpointError(f"{self.where(name)}: {str(err).split(': ', 1)[-1]}") from None
        except FileNotFoundError:
            raise CheckpointError(f"{self.where(name)}: its manifest is committed but the object is missing") from None

    # ------------------------------------------------------------------ writing (data, verify, manifest last)
    def _verify(self, name: str, manifest: dict[str, Any]) -> None:
        size = self.fs.info(self.path(name))["size"]
        if size != manifest["size"]:
            raise OSError(f"{self.where(name)}: {size} bytes on the remote, {manifest['size']} uploaded (torn upload)")
        if Fingerprint.of(self.read(name)) != Fingerprint.recorded(manifest):
            raise OSError(f"{self.where(name)}: the remote bytes' CRC-32 differs from the uploaded file's")

    def _commit(self, name: str, manifest: dict[str, Any]) -> None:
        record = {k: v for k, v in manifest.items() if k != "replaces"}
        self.fs.pipe_file(self.path(name + MANIFEST_SUFFIX), json.dumps({**record, "file": name}, indent=1).encode())

    def holds(self, name: str, manifest: dict[str, Any]) -> bool:
        """``name`` is committed on the remote with this content (same size, CRC-32 and save time)."""
        there = self.manifest(name) or {}
        return all(there.get(k) == manifest.get(k) for k in ("size", "crc32", "saved_at"))

    def commit(self, name: str, source: Path, manifest: dict[str, Any]) -> None:
        """Upload the local file ``source`` as ``name``: data, verify, manifest (the commit)."""
        if self.holds(name, manifest):
            return
        if self._has_directories:
            self.fs.makedirs(self.root, exist_ok=True)
        with open(source, "rb") as f, self.fs.open(self.path(name), "wb", block_size=max(CHUNK, 5 << 20)) as out:
            shutil.copyfileobj(f, out, CHUNK)
        self._verify(name, manifest)
        self._commit(name, manifest)

    def copy(self, source: str, name: str, manifest: dict[str, Any]) -> None:
        """``name`` as a server-side copy of the committed ``source`` (no bytes through this machine), verified."""
        if self.holds(name, manifest):
            return
        self.fs.copy(self.path(source), self.path(name))
        self._verify(name, manifest)
        self._commit(name, manifest)

    def remove(self, name: str) -> None:
        """Removal, in the order a local one takes (:func:`lit_minimind.checkpoint.atomic.remove_file`): the
        manifest first (no longer a candidate here), then the data."""
        for path in (self.path(name + MANIFEST_SUFFIX), self.path(name)):
            try:
                self.fs.rm_file(path)
            except FileNotFoundError:
                pass
