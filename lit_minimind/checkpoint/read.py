"""Reading any checkpoint safely: bytes verified once per file version (against the manifest beside the file,
or without one by :func:`verify_file`), ``weights_only`` always, a pickle that would import code refused with
what it would import.

**verify_file** - is this ``torch.save`` file intact, without a manifest?

``torch.save`` writes a zip archive (PyTorch's ``PyTorchStreamWriter`` on miniz): one stored
(uncompressed) record per pickle / storage, each with a CRC-32. The CRCs cover only the record
*data*; a flipped byte in a header, a file name, the alignment padding, the central directory or
the end records is invisible to them (and to ``zipfile.testzip``), and many such flips still load,
or load something else. So besides the CRCs, every other byte of the file is checked against a
second copy of itself or against the one value ``torch.save`` writes there:

* **tiling**: the file is exactly ``record, record, ..., central directory, [zip64 end record,
  zip64 locator], end record`` with no gap, overlap or trailing byte: the first local header is at
  offset 0, each one starts where the previous record's data descriptor ends, the last ends where
  the central directory starts, which ends where the end records start, which end at EOF;
* **local header vs central directory entry**: version, flags, method, time, date, name length
  and name are equal; local CRC and sizes are 0 (torch streams: they live in the descriptor);
  the central directory's offset is the header's real position;
* **extra fields** are rebuilt and compared byte for byte: torch's ``FB`` padding field (``FB``,
  its length, then ``Z`` bytes) that puts the data on the file's alignment boundary (64 bytes, or
  what its ``.storage_alignment`` record says) with less than one alignment of padding, after
  miniz's zip64 field when one is needed (size or offset >= 4 GiB);
* **data**: its CRC-32 equals the central directory's (a CRC-32 detects every error burst of up to
  32 bits, so every changed byte), and the data descriptor after it repeats signature, CRC and sizes;
* **central directory fields with no second copy** hold what torch writes: version made by 0,
  no comment, disk 0, attributes 0, stored (method 0), equal compressed / uncompressed sizes;
* **end records**: zip64 end record and locator (signature, record size 44, versions 0x031E and
  0x2D, disk numbers, entry counts, directory size and offset) and the classic end record (its
  counts and offsets equal, or saturated at 0xFFFF / 0xFFFFFFFF as miniz writes them, and no
  comment) all agree with the directory actually found.

It reads the file once (plus its first 4 KiB twice): the directory at the end first, then every record in order
in ``chunk_size`` pieces into one reused buffer, computing CRCs as it goes (``zlib.crc32``). A
file that is not a torch zip is classified: empty, a pickle (legacy ``torch.save`` format or a
plain pickle: :class:`NotATorchZip`; it has no checksums), or not a checkpoint at all (JSON,
text, other binary: :class:`NotACheckpoint`). A torch zip saved without CRC-32s
(``torch.serialization.set_crc32_options(False)``) gets its layout checked, then
:class:`UnverifiableCheckpoint` (the parent of :class:`NotATorchZip`).
"""

from __future__ import annotations

import json
import os
import pickle
import struct
import zipfile
import zlib
from pathlib import Path
from typing import Any

import torch

from lit_minimind.checkpoint.atomic import Fingerprint, read_manifest
from lit_minimind.checkpoint.names import manifest_path
from lit_minimind.errors import CheckpointError, NotACheckpoint, NotATorchZip, UnverifiableCheckpoint

__all__ = ["NotACheckpoint", "NotATorchZip", "UnverifiableCheckpoint", "harmful_imports", "read_checkpoint",
           "verify_checkpoint", "verify_file", "verify_manifest"]


def verify_manifest(path: Path, accept_replaced: bool = True) -> None:
    """Check size and CRC-32 against the manifest beside the file: the new file's, or (a save killed
    between manifest and rename) the replaced file's unless ``accept_replaced`` is False."""
    mpath = manifest_path(path)
    if not mpath.exists():
        return
    manifest = read_manifest(path)
    recorded = Fingerprint.recorded(manifest)
    if recorded is None:
        try:  # read again only to say why not
            json.loads(mpath.read_text())["size"]
            reason = "no size and CRC-32 in it"
        except (OSError, ValueError, KeyError, TypeError) as err:
            reason = str(err)
        raise CheckpointError(f"{path}: its manifest {mpath.name} is unreadable ({reason})")
    accepted = [recorded]
    replaced = Fingerprint.recorded(manifest, "replaces")
    if accept_replaced and replaced is not None:  # a save interrupted between manifest and rename
        accepted.append(replaced)
    size = path.stat().st_size
    if size not in {f.size for f in accepted}:
        raise CheckpointError(f"{path}: size {size} bytes differs from the {recorded.size} bytes recorded when it "
                              "was saved (truncated, or damaged)")
    if Fingerprint.of_file(path) not in accepted:
        raise CheckpointError(f"{path}: checksum (crc32) differs from the one recorded when it was saved (corrupted)")


_verified: dict[str, tuple[int, int, int]] = {}


def verify_checkpoint(path: str | os.PathLike) -> None:
    """Check a checkpoint file's bytes, once per version of the file: against its manifest
    (size, CRC-32), or, without one,
    every record CRC and header of torch's zip container (:func:`verify_file`).
    Raises :class:`CheckpointError` naming the file."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint file")
    if path.is_dir():
        raise CheckpointError(f"{path}: is a directory, not a checkpoint file")
    st = path.stat()
    if st.st_size == 0:
        raise CheckpointError(f"{path}: is empty (0 bytes); an interrupted or failed save?")
    version = (st.st_ino, st.st_size, st.st_mtime_ns)
    if _verified.get(str(path)) == version:
        return
    if manifest_path(path).exists():
        verify_manifest(path)
    else:
        try:
            verify_file(path)
        except UnverifiableCheckpoint:
            pass  # torch's legacy (pre-zip) format has no checksums: loading it is all that can be checked
    _verified[str(path)] = version


HARMLESS_IMPORTS = ("torch.", "collections.", "_codecs.encode", "copyreg._reconstructor", "numpy.")


def harmful_imports(pickle_bytes: bytes) -> list[str]:
    """What a pickle would import beyond plain data (``os.system``, ``builtins.eval``, ...), read from its
    opcodes without unpickling it."""
    import io
    import pickletools

    imports: list[str] = []
    strings: list[str] = []
    try:
        for op, arg, _ in pickletools.genops(io.BytesIO(pickle_bytes)):
            if op.name in ("GLOBAL", "INST"):
                imports.append(str(arg).replace(" ", "."))
            elif op.name == "STACK_GLOBAL":
                imports.append(".".join(strings[-2:]))
            elif isinstance(arg, str):
                strings.append(arg)
    except Exception:  # a damaged pickle: what was read so far is still telling
        pass
    return [name for name in dict.fromkeys(imports) if not name.startswith(HARMLESS_IMPORTS)]


def _pickle_of(path: Path) -> bytes:
    """The main pickle of a torch.save file (``data.pkl`` in its zip), or the file itself."""
    try:
        with zipfile.ZipFile(path) as archive:
            name = next(n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl")
            return archive.read(name)
    except (zipfile.BadZipFile, StopIteration, OSError):
        return path.read_bytes()


def read_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu", verify: bool = True) -> dict[str, Any]:
    """Load any checkpoint (ours, Lightning's, original MiniMind's) safely, or explain why not.

    Always ``weights_only=True``: a file whose unpickling would import or call code is
    refused. A Hugging Face directory (``config.json`` + safetensors) of a Qwen3 / Qwen3-MoE model
    with MiniMind's shapes is read by :func:`lit_minimind.checkpoint.hf.read_hf_directory`.
    Raises :class:`CheckpointError` naming the file and what is wrong.
    """
    path = Path(path)
    if path.is_dir():  # only then the Hugging Face reader (a file read never loads it)
        from lit_minimind.checkpoint.hf import is_hf_directory, read_hf_directory

        if is_hf_directory(path):
            return read_hf_directory(path)
    if verify:
        verify_checkpoint(path)
    elif not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    try:
        # mapped, not copied: the tensors are the page cache's until a load_state_dict copies them (MAP_PRIVATE: a
        # write to one never reaches the file); torch's legacy (pre-zip) format cannot be mapped
        obj = torch.load(path, map_location=map_location, weights_only=True, mmap=zipfile.is_zipfile(path))
    except pickle.UnpicklingError as err:
        text = str(err)
        harmful = harmful_imports(_pickle_of(path))
        if harmful:
            raise CheckpointError(
                f"{path}: refused to load: unpickling it would import and run {', '.join(harmful[:5])}, code outside "
                "plain tensors and containers. Only load checkpoints you trust; this one is not a plain checkpoint."
            ) from None
        raise CheckpointError(f"{path}: not a readable torch checkpoint ({text.splitlines()[0]})") from None
    except Exception as err:  # torch raises many types for damaged bytes (RuntimeError, EOFError, KeyError, ...)
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise CheckpointError(f"{path}: truncated or corrupted checkpoint ({first})") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: holds a {type(obj).__name__}, not a checkpoint dict")
    return obj


# ----------------------------------------------------------------------------- verify_file: torch's zip, checked

CHUNK_SIZE = 1 << 20  # fits in L2: the CRC reads what readinto just wrote, from cache
ALIGNMENT = 64  # torch's default: record data starts on a 64-byte boundary (``.storage_alignment`` record)
U16, U32 = 0xFFFF, 0xFFFFFFFF

LOCAL = struct.Struct("<4sHHHHHIIIHH")  # 30 bytes
CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")  # 46 bytes
DESCRIPTOR32 = struct.Struct("<4sIII")  # 16 bytes
DESCRIPTOR64 = struct.Struct("<4sIQQ")  # 24 bytes
END = struct.Struct("<4sHHHHIIH")  # 22 bytes
END64 = struct.Struct("<4sQHHIIQQQQ")  # 56 bytes
LOCATOR64 = struct.Struct("<4sIQI")  # 20 bytes

LOCAL_SIG, CENTRAL_SIG, DESCRIPTOR_SIG = b"PK\x03\x04", b"PK\x01\x02", b"PK\x07\x08"
END_SIG, END64_SIG, LOCATOR64_SIG = b"PK\x05\x06", b"PK\x06\x06", b"PK\x06\x07"
FLAG_DESCRIPTOR, FLAG_UTF8 = 0x0008, 0x0800
LEGACY_MAGIC = b"\x8a\x0a" + (0x1950A86A20F9469CFC6C).to_bytes(10, "little")  # torch's pre-1.6 format


class _Entry:
    """One central directory entry, with every field decoded."""

    __slots__ = ("index", "name", "version", "flags", "method", "time", "date", "crc", "size", "offset", "zip64")

    def __init__(self, **fields: object) -> None:
        for key, value in fields.items():
            setattr(self, key, value)

    @property
    def label(self) -> str:
        return f"record {self.name.decode('utf-8', 'backslashreplace')!r}"


def verify_file(path: str | os.PathLike, *, chunk_size: int = CHUNK_SIZE) -> None:
    """Raise :class:`CheckpointError` unless ``path`` is a ``torch.save`` zip exactly as written.

    Detects any changed byte (or truncation, or appended bytes) anywhere in the file: in record
    data through the CRC-32s, everywhere else through the structural checks described in the
    module docstring. Subclasses: :class:`NotACheckpoint` (JSON, text, other binary) and
    :class:`UnverifiableCheckpoint` (no checksums: saved without CRC-32s, or a pickle,
    :class:`NotATorchZip`); ``torch.load`` may still read the latter.
    """
    path = Path(path)
    try:
        f = open(path, "rb", buffering=0)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such checkpoint file") from None
    except IsADirectoryError:
        raise CheckpointError(f"{path}: is a directory, not a checkpoint file") from None
    except OSError as err:
        raise CheckpointError(f"{path}: cannot be read ({err.strerror or err})") from None
    with f:
        try:
            _Verifier(path, f, max(int(chunk_size), 1)).run()
        except OSError as err:
            raise CheckpointError(f"{path}: cannot be read ({err.strerror or err})") from None


class _Verifier:
    def __init__(self, path: Path, f, chunk_size: int) -> None:
        self.path, self.f, self.fd = path, f, f.fileno()
        self.size = os.fstat(self.fd).st_size
        self.chunk_size = chunk_size

    # ------------------------------------------------------------------ helpers

    def fail(self, detail: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: truncated or corrupted checkpoint: {detail}")

    def pread(self, n: int, offset: int) -> bytes:
        data = os.pread(self.fd, n, offset)
        if len(data) != n:  # the file shrank while being read
            raise self.fail(f"{n} bytes expected at offset {offset}, {len(data)} read")
        return data

    # ------------------------------------------------------------------ the check

    def run(self) -> None:
        if self.size == 0:
            raise CheckpointError(f"{self.path}: is empty (0 bytes); an interrupted or failed save?")
        head = self.pread(min(self.size, 4096), 0)
        tail_sig = self.pread(4, self.size - END.size)[:4] if self.size >= END.size else b""
        if head[:4] != LOCAL_SIG:
            if LOCAL_SIG.startswith(head):
                raise self.fail(f"{self.size} bytes: only the start of a zip signature")
            near_miss = len(head) >= 4 and sum(a != b for a, b in zip(head[:4], LOCAL_SIG)) == 1
            if not (near_miss or tail_sig == END_SIG):
                self.classify(head)  # raises
            raise self.fail(f"no local file header at offset 0 (starts with {head[:4].hex()})")
        self.check_is_torch(head)
        entries, cd_offset = self.read_directory()
        self.check_records(entries, cd_offset)

    def classify(self, head: bytes) -> None:
        """Raise the right error for a file that does not start as a zip."""
        path = self.path
        if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
            legacy = head[2:14] == LEGACY_MAGIC
            what = "torch's legacy (pre-1.6, non-zip) format" if legacy else "a plain pickle"
            raise NotATorchZip(f"{path}: not a torch zip checkpoint: {what}; it carries no checksums to verify", legacy)
        if head.startswith(b"PK"):
            raise NotACheckpoint(f"{path}: not a checkpoint: a zip archive without records (or of another kind)")
        text = _as_text(head, complete=self.size <= len(head))
        if text is not None:
            stripped = text.lstrip()
            kind = "text"
            if stripped[:1] in ("{", "["):
                kind = "JSON"
                if self.size <= 1 << 20:
                    try:
                        json.loads(Path(path).read_bytes())
                    except ValueError:
                        kind = "JSON-like text"
            raise NotACheckpoint(f"{path}: not a checkpoint: {kind} ({self.size} bytes)")
        raise NotACheckpoint(f"{path}: not a checkpoint: unrecognised binary content ({self.size} bytes, "
                             f"starts with {head[:8].hex()})")

    def read_directory(self) -> tuple[list[_Entry], int]:
        """Parse and check the end records and the central directory; return entries and its offset."""
        size = self.size
        if size < LOCAL.size + CENTRAL.size + END.size:
            raise self.fail(f"{size} bytes is too short for a torch zip archive")
        end = END.unpack(self.pread(END.size, size - END.size))
        sig, disk, cd_disk, n_disk, n_total, cd_size32, cd_offset32, comment_len = end
        if sig != END_SIG:
            raise self.fail(self.missing_end_record())
        if (disk, cd_disk, comment_len) != (0, 0, 0):
            raise self.fail(f"end-of-central-directory record has disk {disk}/{cd_disk}, comment length "
                            f"{comment_len} (torch writes 0/0, 0)")
        if n_disk != n_total:
            raise self.fail(f"end-of-central-directory record counts {n_disk} and {n_total} entries")
        cd_end = size - END.size
        locator = self.pread(LOCATOR64.size, size - END.size - LOCATOR64.size) if size >= 98 + LOCAL.size else b""
        if locator[:4] == LOCATOR64_SIG:
            _, z64_disk, z64_offset, disks = LOCATOR64.unpack(locator)
            cd_end = size - END.size - LOCATOR64.size - END64.size
            if (z64_disk, disks) != (0, 1) or z64_offset != cd_end:
                raise self.fail(f"zip64 locator says disk {z64_disk} of {disks}, record at {z64_offset} "
                                f"(expected disk 0 of 1, record at {cd_end})")
            (sig, rec_size, made_by, needed, disk, cd_disk, n_disk, n, cd_size, cd_offset) = END64.unpack(
                self.pread(END64.size, cd_end))
            expected = (END64_SIG, END64.size - 12, 0x031E, 0x2D, 0, 0, n)
            if (sig, rec_size, made_by, needed, disk, cd_disk, n_disk) != expected:
                raise self.fail("zip64 end-of-central-directory record differs from what torch writes "
                                f"({sig!r}, size {rec_size}, versions {made_by:#x}/{needed:#x}, disks {disk}/{cd_disk}, "
                                f"entries {n_disk}/{n})")
            if (n_total, cd_size32, cd_offset32) != (min(n, U16), min(cd_size, U32), min(cd_offset, U32)):
                raise self.fail(f"end-of-central-directory record ({n_total} entries, {cd_size32} bytes at "
                                f"{cd_offset32}) disagrees with the zip64 one ({n} entries, {cd_size} bytes at {cd_offset})")
        else:
            if U16 in (n_total,) or U32 in (cd_size32, cd_offset32):
                raise self.fail("end-of-central-directory record needs a zip64 record, and there is none")
            n, cd_size, cd_offset = n_total, cd_size32, cd_offset32
        if cd_offset + cd_size != cd_end:
            raise self.fail(f"central directory ({cd_size} bytes at offset {cd_offset}) does not end where the "
                            f"end records start ({cd_end})")
        return self.parse_directory(self.pread(cd_size, cd_offset), n, cd_offset), cd_offset

    def missing_end_record(self) -> str:
        window = self.pread(min(self.size, (1 << 16) + 4096), self.size - min(self.size, (1 << 16) + 4096))
        at = window.rfind(END_SIG)
        if at >= 0:
            extra = len(window) - at - END.size
            if extra > 0:
                return (f"{extra} bytes follow what looks like the end-of-central-directory record "
                        "(appended data, or a damaged end)")
        return "no end-of-central-directory record at the end of the file (cut short, or its end damaged)"

    def parse_directory(self, cd: bytes, n: int, cd_offset: int) -> list[_Entry]:
        entries: list[_Entry] = []
        pos = 0
        while pos < len(cd):
            if pos + CENTRAL.size > len(cd):
                raise self.fail(f"central directory entry {len(entries)} at offset {cd_offset + pos} is cut off")
            (sig, made_by, version, flags, method, time, date, crc, csize32, usize32, name_len, extra_len,
             comment_len, disk, internal, external, offset32) = CENTRAL.unpack_from(cd, pos)
            where = f"central directory entry {len(entries)} (offset {cd_offset + pos})"
            if sig != CENTRAL_SIG:
                raise self.fail(f"{where}: bad signature {sig.hex()}")
            if (made_by, comment_len, disk, internal, external) != (0, 0, 0, 0, 0):
                raise self.fail(f"{where}: version made by {made_by}, comment length {comment_len}, disk {disk}, "
                                f"attributes {internal}/{external} (torch writes 0 for all)")
            start = pos + CENTRAL.size
            pos = start + name_len + extra_len
            if pos > len(cd):
                raise self.fail(f"{where}: name and extra field run past the central directory")
            name, extra = cd[start:start + name_len], cd[start + name_len:pos]
            size, offset, zip64 = usize32, offset32, usize32 == U32 or offset32 == U32
            if zip64:  # miniz: 32-bit field saturated <=> the value is in the zip64 extra field
                size, offset = self.parse_zip64_extra(where, extra, usize32 == U32, offset32 == U32, csize32)
                if size is None:
                    size = usize32
                if offset is None:
                    offset = offset32
            if extra != _zip64_field(size if usize32 == U32 else None, size if usize32 == U32 else None,
                                     offset if offset32 == U32 else None):
                raise self.fail(f"{where}: extra field {extra.hex()} is not what torch writes for this entry")
            if method != 0 or csize32 != usize32:
                raise self.fail(f"{where}: method {method}, sizes {csize32}/{usize32} (torch stores records "
                                "uncompressed: method 0, equal sizes)")
            if flags & ~(FLAG_DESCRIPTOR | FLAG_UTF8) or bool(flags & FLAG_DESCRIPTOR) != (size > 0):
                raise self.fail(f"{where}: flags {flags:#06x} (torch writes 0x0808, or 0x0800 for an empty record)")
            if size == 0 and crc != 0:
                raise self.fail(f"{where}: empty record with CRC-32 {crc:08x} (must be 0)")
            entries.append(_Entry(index=len(entries), name=name, version=version, flags=flags, method=method,
                                  time=time, date=date, crc=crc, size=size, offset=offset, zip64=zip64))
        if len(entries) != n:
            raise self.fail(f"central directory holds {len(entries)} entries, the end record says {n}")
        return entries

    def parse_zip64_extra(self, where: str, extra: bytes, has_size: bool, has_offset: bool,
                          csize32: int) -> tuple[int | None, int | None]:
        want = 8 * (2 * has_size + has_offset)
        if len(extra) != 4 + want or extra[:4] != struct.pack("<HH", 1, want):
            raise self.fail(f"{where}: saturated 32-bit fields but no matching zip64 extra field ({extra.hex()})")
        values = list(struct.unpack_from(f"<{want // 8}Q", extra, 4))
        size = offset = None
        if has_size:
            size, comp = values.pop(0), values.pop(0)
            if comp != size or size < U32 or csize32 != U32:
                raise self.fail(f"{where}: zip64 sizes {size}/{comp} are inconsistent")
        if has_offset:
            offset = values.pop(0)
            if offset < U32:
                raise self.fail(f"{where}: zip64 offset {offset} below 4 GiB")
        return size, offset

    def check_is_torch(self, head: bytes) -> None:
        """torch.save writes ``<archive>/data.pkl`` first; a zip with no such record anywhere is another kind."""
        if len(head) < LOCAL.size or LOCAL.size + LOCAL.unpack_from(head)[9] > self.size:
            raise self.fail(f"{self.size} bytes end inside the first record's header")
        if head[LOCAL.size:LOCAL.size + LOCAL.unpack_from(head)[9]].endswith(b"data.pkl"):
            return
        window = min(self.size, 1 << 20)  # the central directory, unless the first name is just damaged
        if b"data.pkl" not in self.pread(window, self.size - window):
            raise NotACheckpoint(f"{self.path}: not a checkpoint: a zip archive that torch.save did not write "
                                 "(no data.pkl record)")

    def storage_alignment(self, entries: list[_Entry], without_crc: bool) -> int:
        """The data alignment torch used (``torch.utils.serialization.config.save.storage_alignment``),
        from the ``.storage_alignment`` record (a few bytes read ahead); 64 in files older than it."""
        e = next((e for e in entries if e.name.rsplit(b"/", 1)[-1] == b".storage_alignment"), None)
        if e is None:
            return ALIGNMENT
        if not 0 < e.size <= 16 or e.offset + LOCAL.size > self.size:
            raise self.fail(f"{e.label}: size {e.size} at offset {e.offset} cannot hold an alignment")
        name_len, extra_len = LOCAL.unpack(self.pread(LOCAL.size, e.offset))[9:]
        start = e.offset + LOCAL.size + name_len + extra_len
        data = self.pread(e.size, start) if start + e.size <= self.size else b""
        if not without_crc and zlib.crc32(data) != e.crc:
            raise self.fail(f"{e.label}: data (bytes {start}-{start + e.size}) fail the CRC-32 check")
        if not data.isdigit() or not 0 < int(data) <= 1 << 16:
            raise self.fail(f"{e.label}: {data!r} is not an alignment")
        return int(data)

    def check_records(self, entries: list[_Entry], cd_offset: int) -> None:
        # torch.serialization.set_crc32_options(False) writes 0 for every CRC: check the rest anyway
        without_crc = all(e.crc == 0 for e in entries if e.size)
        alignment = self.storage_alignment(entries, without_crc)
        stream = _Stream(self, cd_offset, self.chunk_size)
        for e in entries:
            if e.offset != stream.pos:
                raise self.fail(f"{e.label}: the central directory puts its header at offset {e.offset}, "
                                f"the previous record ends at {stream.pos}")
            (sig, version, flags, method, time, date, crc, csize, usize, name_len,
             extra_len) = LOCAL.unpack(stream.read(LOCAL.size, e))
            if sig != LOCAL_SIG:
                raise self.fail(f"{e.label}: bad local header signature {sig.hex()} at offset {e.offset}")
            if (version, flags, method, time, date, name_len) != (e.version, e.flags, e.method, e.time, e.date, len(e.name)):
                raise self.fail(f"{e.label}: local header at offset {e.offset} disagrees with the central directory "
                                f"(version {version}/{e.version}, flags {flags:#x}/{e.flags:#x}, method {method}/{e.method}, "
                                f"time {time}/{e.time}, date {date}/{e.date}, name length {name_len}/{len(e.name)})")
            if (crc, csize, usize) != (0, 0, 0):
                raise self.fail(f"{e.label}: local header CRC/sizes {crc:08x}/{csize}/{usize} (torch writes 0: "
                                "they follow the data)")
            name = stream.read(name_len, e)
            if name != e.name:
                raise self.fail(f"{e.label}: local header names it {name!r}")
            extra = stream.read(extra_len, e)
            expected = _local_extra(e, stream.pos - extra_len, alignment)
            if extra != expected:
                raise self.fail(f"{e.label}: local extra field ({extra_len} bytes) is not torch's "
                                f"{'zip64 field and ' if e.zip64 else ''}{alignment}-byte alignment padding "
                                f"({len(expected)} bytes: FB, length, Z...)")
            data_start = stream.pos
            actual = stream.crc32(e.size, e)
            if actual != e.crc and not without_crc:
                raise self.fail(f"{e.label}: data (bytes {data_start}-{data_start + e.size}) fail the CRC-32 check: "
                                f"stored {e.crc:08x}, computed {actual:08x}")
            if e.flags & FLAG_DESCRIPTOR:
                layout = DESCRIPTOR64 if e.zip64 else DESCRIPTOR32
                sig, crc, csize, usize = layout.unpack(stream.read(layout.size, e))
                if (sig, crc, csize, usize) != (DESCRIPTOR_SIG, e.crc, e.size, e.size):
                    raise self.fail(f"{e.label}: data descriptor ({sig.hex()}, CRC {crc:08x}, sizes {csize}/{usize}) "
                                    f"disagrees with the central directory (CRC {e.crc:08x}, size {e.size})")
        if stream.pos != cd_offset:
            raise self.fail(f"{cd_offset - stream.pos} bytes between the last record (ends at {stream.pos}) and the "
                            f"central directory (at {cd_offset}) belong to no record")
        if without_crc:
            raise UnverifiableCheckpoint(
                f"{self.path}: saved without CRC-32s (torch.serialization.set_crc32_options(False)): its zip layout "
                "is intact, its data cannot be verified")


class _Stream:
    """Sequential reader of ``[0, end)``: one reused buffer, ``readinto``, CRC on memoryview slices."""

    def __init__(self, verifier: _Verifier, end: int, chunk_size: int) -> None:
        self.v, self.end = verifier, end
        self.buf = bytearray(max(1, min(chunk_size, end)))  # a small file needs no 1 MiB buffer
        self.view = memoryview(self.buf)
        self.lo = self.hi = 0  # unread bytes: buf[lo:hi]
        self.pos = 0  # file offset of buf[lo]
        self.file_pos = 0  # file offset of buf[hi]
        f = verifier.f
        f.seek(0)
        try:
            os.posix_fadvise(verifier.fd, 0, end, os.POSIX_FADV_SEQUENTIAL)
        except (AttributeError, OSError):
            pass

    def _readinto(self, start: int) -> int:
        want = min(len(self.buf) - start, self.end - self.file_pos)
        if want <= 0:
            return 0
        got = self.v.f.readinto(self.view[start:start + want])
        self.file_pos += got or 0
        return got or 0

    def _cut_off(self, what: int, e: _Entry) -> CheckpointError:
        return self.v.fail(f"{e.label}: {what} bytes needed at offset {self.pos} run past the central directory "
                           f"(at {self.end})")

    def read(self, n: int, e: _Entry) -> bytes:
        if self.hi - self.lo >= n:  # the usual case: a header inside the buffer
            data = bytes(self.view[self.lo:self.lo + n])
            self.lo += n
            self.pos += n
            return data
        out = bytearray()
        while len(out) < n:
            if self.lo == self.hi:
                self.lo, self.hi = 0, self._readinto(0)
                if not self.hi:
                    raise self._cut_off(n, e)
            take = min(n - len(out), self.hi - self.lo)
            out += self.view[self.lo:self.lo + take]
            self.lo += take
            self.pos += take
        return bytes(out)

    def crc32(self, n: int, e: _Entry) -> int:
        take = min(n, self.hi - self.lo)
        crc = zlib.crc32(self.view[self.lo:self.lo + take])
        self.lo += take
        self.pos += take
        n -= take
        while n:
            self.lo = self.hi = 0
            got = self._readinto(0)
            if not got:
                raise self._cut_off(n, e)
            self.hi = got
            take = min(n, got)
            crc = zlib.crc32(self.view[:take], crc)
            self.lo = take
            self.pos += take
            n -= take
        return crc


def _zip64_field(usize: int | None, csize: int | None, offset: int | None) -> bytes:
    """miniz's zip64 extended-information field for the values given (b"" when none)."""
    values = [v for v in (usize, csize, offset) if v is not None]
    if not values:
        return b""
    return struct.pack(f"<HH{len(values)}Q", 1, 8 * len(values), *values)


def _local_extra(e: _Entry, extra_start: int, alignment: int) -> bytes:
    """The local extra field torch writes: miniz's zip64 field if needed, then torch's ``FB`` padding.

    miniz writes the local zip64 field before the data, so its compressed size is still 0.
    """
    offset = e.offset
    zip64 = _zip64_field(e.size if e.size >= U32 else None, 0 if e.size >= U32 else None,
                         offset if offset >= U32 else None) if e.zip64 else b""
    pad = -(extra_start + len(zip64) + 4) % alignment
    return zip64 + b"FB" + struct.pack("<H", pad) + b"Z" * pad


def _as_text(head: bytes, complete: bool) -> str | None:
    """``head`` decoded when it is (the start of) UTF-8 text without control bytes, else None."""
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as err:
        if complete or err.start < len(head) - 3:  # not just a character cut at the end of the window
            return None
        text = head[:err.start].decode("utf-8")
    controls = sum(1 for c in text if ord(c) < 32 and c not in "\t\n\r\f\v")
    return text if text and controls == 0 else None
