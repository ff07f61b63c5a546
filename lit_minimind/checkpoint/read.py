"""Reading any checkpoint safely: bytes verified once per file version, ``weights_only`` always,
a pickle that would import code refused with what it would import."""

from __future__ import annotations

import json
import os
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch

from lit_minimind.checkpoint.atomic import Fingerprint, read_manifest
from lit_minimind.checkpoint.names import manifest_path
from lit_minimind.checkpoint.verify import UnverifiableCheckpoint, verify_file
from lit_minimind.errors import CheckpointError


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
    every record CRC and header of torch's zip container (:func:`lit_minimind.checkpoint.verify.verify_file`).
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


