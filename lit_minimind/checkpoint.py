"""MiniMind's checkpoint files: one writer and one reader for the CLI, the callback and the library.

The file layout is MiniMind's (lesson 15):

* ``{out_dir}/{weight}_{hidden}{_moe}.pth`` - fp16 CPU state dict with MiniMind's keys;
* ``{ckpt_dir}/{weight}_{hidden}{_moe}_resume.pth`` - ``model`` (fp16), ``optimizer``,
  ``epoch``, ``step``, ``world_size``, ``wandb_id``, ``scaler``; plus, under ``lit_minimind``,
  what an exact resume needs (fp32 weights, RNG, partial gradients, global step, config,
  versions). Original MiniMind still loads these files.

Every write is atomic (tmp file in the same directory, fsync, ``os.replace``) and is
followed by a manifest ``<file>.manifest.json`` recording size and CRC-32, so a reader can
tell a complete file from a torn or corrupted one. Every read is ``weights_only``.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import pickle
import platform
import shutil
import time
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

import torch
import torch.distributed as dist
from torch import nn

from lit_minimind.position import corrected_step

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
EXTRA_KEY = "lit_minimind"
MANIFEST_SUFFIX = ".manifest.json"
MINIMIND_KEYS = ("model", "optimizer", "epoch", "step")


class CheckpointError(RuntimeError):
    """A checkpoint file that cannot be used; the message names the file and the problem."""


# ----------------------------------------------------------------------------- paths


def checkpoint_paths(save_dir: str | os.PathLike, weight: str, hidden_size: int, use_moe: bool = False) -> tuple[Path, Path]:
    """MiniMind's names: ``(save_dir/{weight}_{hidden}{_moe}.pth, save_dir/..._resume.pth)``."""
    weights, resume = minimind_file_names(checkpoint_stem(weight, hidden_size, use_moe))
    return Path(save_dir) / weights, Path(save_dir) / resume


def minimind_file_names(stem: str) -> tuple[str, str]:
    """MiniMind's two file names for a stem: the fp16 export and the resume checkpoint."""
    return f"{stem}.pth", f"{stem}_resume.pth"


def checkpoint_stem(weight: str, hidden_size: int, use_moe: bool = False) -> str:
    return f"{weight}_{hidden_size}{'_moe' if use_moe else ''}"


def manifest_path(path: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(path)}{MANIFEST_SUFFIX}")


# ----------------------------------------------------------------------------- writing


class _HashingWriter:
    """File wrapper that checksums what ``torch.save`` writes, so no second read is needed.

    CRC-32 (zlib, ~7 GB/s here) rather than sha256 (~2 GB/s): it detects truncation and bit rot,
    which is its job here, at a quarter of the cost on the training thread.
    """

    def __init__(self, f: BinaryIO, path: Path | None = None) -> None:
        self._f = f
        self._path = path
        self.crc32 = 0
        self.size = 0
        self.error: OSError | None = None  # torch's zip writer hides it behind a RuntimeError

    def write(self, data: bytes) -> int:
        self.crc32 = zlib.crc32(data, self.crc32)
        self.size += len(data)
        try:
            if self._path is not None and self.size == len(data):
                _test_fault("write", self._path)
            return self._f.write(data)
        except OSError as err:
            self.error = err
            raise

    def flush(self) -> None:
        self._f.flush()


def _fsync_dir(path: Path) -> None:
    """Make the rename of ``path`` durable: fsync its directory. Filesystems that cannot fsync a
    directory are skipped; a real I/O error (EIO, ENOSPC) is raised."""
    try:
        fd = os.open(path.parent, os.O_RDONLY)
    except OSError:  # not supported everywhere (e.g. some network filesystems)
        return
    try:
        _test_fault("dirfsync", path)
        os.fsync(fd)
    except OSError as err:
        if err.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


_faults_seen: dict[str, int] = {}


def _test_fault(op: str, path: Path) -> None:
    """Test-only fault injection: ``LIT_MINIMIND_TEST_FAIL=OP:SUFFIX:N:ERRNO`` makes the N-th ``OP``
    (``write``, ``fsync``, ``manifest``, ``rename``, ``dirfsync``) on a file whose name ends with
    ``SUFFIX`` fail with ``ERRNO`` (``ENOSPC``, ``EIO``, ...), as a full or failing disk would.
    Does nothing otherwise."""
    spec = os.environ.get("LIT_MINIMIND_TEST_FAIL")
    if not spec:
        return
    want, suffix, nth, code = spec.split(":")
    if want != op or not path.name.removesuffix(".tmp").endswith(suffix):
        return
    _faults_seen[op] = _faults_seen.get(op, 0) + 1
    if _faults_seen[op] == int(nth):
        number = getattr(errno, code)
        raise OSError(number, os.strerror(number), str(path))


_commits_in_process: dict[str, int] = {}


def _test_pause(path: Path, moment: str) -> None:
    """Test-only: with ``LIT_MINIMIND_TEST_STOP_IN_SAVE=N`` the N-th file commit of this process stops
    itself (SIGSTOP) with its tmp file complete but not yet in place; with
    ``LIT_MINIMIND_TEST_STOP_AFTER_SAVE=N`` right after the N-th commit (``N:.ckpt`` counts only
    files with that suffix). A test then SIGKILLs it there, deterministically. Does nothing otherwise."""
    target = os.environ.get(f"LIT_MINIMIND_TEST_STOP_{moment.upper()}_SAVE")
    if not target:
        return
    count, _, suffix = target.partition(":")
    name = path.name.removesuffix(".tmp")
    if suffix and not name.endswith(suffix):
        return
    _commits_in_process[moment] = _commits_in_process.get(moment, 0) + 1
    if _commits_in_process[moment] == int(count):
        import signal

        import threading

        print(f"@@stopped-{moment}-save {path}", flush=True)
        # to this thread (the background writer, maybe): it stops here, before its next instruction
        signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)


def atomic_save(obj: Any, path: str | os.PathLike, meta: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The one writer: ``torch.save`` to ``path`` atomically, with a manifest (size, CRC-32) beside it.

    Order: data to a tmp file (fsync), manifest (fsync, atomic), ``os.replace`` of the data, fsync
    of the directory. The manifest also lists the file it replaces, so at every moment the file
    on disk - old or new - matches its manifest. Any failure (ENOSPC, EFBIG, EACCES, a kill)
    leaves the previous file intact, at most with a ``.tmp`` beside it. Returns the manifest.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            writer = _HashingWriter(f, path)
            try:
                torch.save(obj, writer)
            except RuntimeError:
                if writer.error is not None:
                    raise writer.error from None  # the real cause: ENOSPC, EFBIG, EIO, ...
                raise
            f.flush()
            _test_fault("fsync", path)
            os.fsync(f.fileno())
        return _commit(tmp, path, {"size": writer.size, "crc32": f"{writer.crc32:08x}", **(meta or {})})
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_link(source: str | os.PathLike, path: str | os.PathLike) -> dict[str, Any]:
    """Make ``path`` the same file as ``source`` (a hard link: no bytes written; a copy where the
    filesystem has no hard links), atomically, with ``source``'s manifest."""
    source, path = Path(source), Path(path)
    tmp = path.with_name(f"{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        try:
            _test_fault("link", path)
            os.link(source, tmp)
        except OSError as err:
            if err.errno not in (errno.EPERM, errno.EXDEV, errno.ENOTSUP, errno.EMLINK):
                raise
            shutil.copyfile(source, tmp)  # a filesystem without hard links
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        return _commit(tmp, path, {k: v for k, v in read_manifest(source).items() if k not in ("file", "replaces")})
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _commit(tmp: Path, path: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """Manifest (listing the file it replaces) first, then the rename, then the directory fsync."""
    previous = read_manifest(path) if path.exists() else {}
    manifest = {"file": path.name, **manifest, "saved_at": manifest.get("saved_at") or time.time_ns()}
    if "size" in previous and "crc32" in previous:
        manifest["replaces"] = {"size": previous["size"], "crc32": previous["crc32"]}
    mtmp = manifest_path(path).with_suffix(".tmp")
    try:
        _test_fault("manifest", path)
        with open(mtmp, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(mtmp, manifest_path(path))
    except BaseException:
        mtmp.unlink(missing_ok=True)
        raise
    _test_pause(tmp, "in")
    _test_fault("rename", path)
    os.replace(tmp, path)
    _fsync_dir(path)
    _test_pause(path, "after")
    return manifest


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The manifest saved beside ``path`` ({} when absent or unreadable)."""
    try:
        return json.loads(manifest_path(path).read_text())
    except (OSError, ValueError):
        return {}


def unwrap_model(model: nn.Module) -> nn.Module:
    """The bare model under DDP (``.module``), ``torch.compile`` (``_orig_mod``) or our LightningModule."""
    model = getattr(model, "module", model)
    model = getattr(model, "_orig_mod", model)
    inner = getattr(model, "model", None)
    if isinstance(inner, nn.Module) and hasattr(inner, "lm_head"):  # LitMiniMind -> MiniMindForCausalLM
        model = inner
    return model


def fp16_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """MiniMind's export: every tensor of the unwrapped model's state dict as fp16 on CPU."""
    return {k: v.detach().half().cpu() for k, v in unwrap_model(model).state_dict().items()}


def current_world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def library_versions() -> dict[str, str]:
    import lightning

    from lit_minimind import __version__

    return {"lit_minimind": str(__version__), "torch": str(torch.__version__), "lightning": str(lightning.__version__), "python": platform.python_version()}


def save_resume_checkpoint(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    save_dir: str | os.PathLike,
    weight: str,
    hidden_size: int,
    use_moe: bool,
    epoch: int,
    step: int,
    scaler: Any | None = None,
    extra_state: Mapping[str, Any] | None = None,
    weights_dir: str | os.PathLike | None = None,
    wandb_id: str | None = None,
    world_size: int | None = None,
) -> tuple[Path, Path]:
    """Write MiniMind's two files (fp16 weights and the resume dict) atomically.

    ``weights_dir`` (default ``save_dir``) receives the fp16 weights, as MiniMind's
    ``out/``; ``extra_state`` entries are merged into the resume dict (objects with a
    ``state_dict()`` are stored by their state dict, as MiniMind's ``**kwargs``).
    Returns ``(weights_path, resume_path)``.
    """
    weights_path, _ = checkpoint_paths(weights_dir or save_dir, weight, hidden_size, use_moe)
    _, resume_path = checkpoint_paths(save_dir, weight, hidden_size, use_moe)
    weights = fp16_state_dict(model)
    world_size = current_world_size() if world_size is None else world_size
    position = {"epoch": epoch, "step": step, "world_size": world_size}
    atomic_save(weights, weights_path, {"kind": "weights", **position})
    resume: dict[str, Any] = {
        "model": weights,
        "optimizer": optimizer.state_dict(),
        **position,
        "wandb_id": wandb_id,
    }
    # always present: MiniMind's loader calls scaler.load_state_dict(ckp["scaler"]) unconditionally
    resume["scaler"] = scaler.state_dict() if scaler is not None else {}
    for key, value in (extra_state or {}).items():
        if value is not None:
            resume[key] = value.state_dict() if hasattr(value, "state_dict") else value
    atomic_save(resume, resume_path, {"kind": "minimind_resume", **position, "wandb_id": wandb_id})
    return weights_path, resume_path


# ----------------------------------------------------------------------------- reading


def verify_manifest(path: Path, accept_replaced: bool = True) -> None:
    """Check size and CRC-32 against the manifest beside the file: the new file's, or (a save killed
    between manifest and rename) the replaced file's unless ``accept_replaced`` is False."""
    mpath = manifest_path(path)
    if not mpath.exists():
        return
    try:
        manifest = json.loads(mpath.read_text())
        accepted = [(int(manifest["size"]), str(manifest["crc32"]))]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{path}: its manifest {mpath.name} is unreadable ({err})") from err
    if accept_replaced and isinstance(manifest.get("replaces"), dict):  # a save interrupted between manifest and rename
        accepted.append((int(manifest["replaces"]["size"]), str(manifest["replaces"]["crc32"])))
    size = path.stat().st_size
    if size not in {s for s, _ in accepted}:
        raise CheckpointError(
            f"{path}: size {size} bytes differs from the {accepted[0][0]} bytes recorded when it was saved "
            "(truncated, or damaged)"
        )
    crc = 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            crc = zlib.crc32(chunk, crc)
    if (size, f"{crc:08x}") not in accepted:
        raise CheckpointError(f"{path}: checksum (crc32) differs from the one recorded when it was saved (corrupted)")


_verified: dict[str, tuple[int, int, int]] = {}


def verify_checkpoint(path: str | os.PathLike) -> None:
    """Check a checkpoint file's bytes, once per version of the file: against its manifest (size,
    CRC-32), or, without one, every record CRC and header of torch's zip container
    (:func:`lit_minimind.verify.verify_file`). Raises :class:`CheckpointError` naming the file."""
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
        from lit_minimind.verify import UnverifiableCheckpoint, verify_file

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
    import zipfile

    try:
        with zipfile.ZipFile(path) as archive:
            name = next(n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl")
            return archive.read(name)
    except (zipfile.BadZipFile, StopIteration, OSError):
        return path.read_bytes()


def read_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu", verify: bool = True) -> dict[str, Any]:
    """Load any checkpoint (ours, Lightning's, original MiniMind's) safely, or explain why not.

    Always ``weights_only=True``: a file whose unpickling would import or call code is
    refused. Raises :class:`CheckpointError` naming the file and what is wrong.
    """
    path = Path(path)
    if verify:
        verify_checkpoint(path)
    elif not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    try:
        obj = torch.load(path, map_location=map_location, weights_only=True)
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


def peek_wandb_id(path: str | os.PathLike) -> str | None:
    """The wandb run id stored with a checkpoint: from its manifest, else from the file itself."""
    meta = read_manifest(path)
    if "wandb_id" in meta:
        return meta["wandb_id"]
    try:  # memory-mapped: only the small entries are read, not the tensors
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:
        return None  # the resume itself reports what is wrong with the file
    return ckpt.get("wandb_id") if isinstance(ckpt, dict) else None


def checkpoint_kind(ckpt: Mapping[str, Any]) -> str:
    """``lightning``, ``minimind_resume``, ``weights`` or ``unknown``."""
    if "state_dict" in ckpt and "pytorch-lightning_version" in ckpt:
        return "lightning"
    if all(k in ckpt for k in MINIMIND_KEYS):
        return "minimind_resume"
    if ckpt and all(isinstance(v, torch.Tensor) for v in ckpt.values()):
        return "weights"
    return "unknown"


def load_resume_checkpoint(
    save_dir: str | os.PathLike,
    weight: str,
    hidden_size: int,
    use_moe: bool = False,
    map_location: str | torch.device = "cpu",
    world_size: int | None = None,
) -> dict[str, Any] | None:
    """Read ``{save_dir}/{weight}_{hidden}{_moe}_resume.pth`` (``None`` when absent).

    As MiniMind's ``lm_checkpoint``, ``step`` is corrected when the saved world size
    differs from the current one (``world_size``, default: the process group's).
    """
    _, resume_path = checkpoint_paths(save_dir, weight, hidden_size, use_moe)
    if not resume_path.exists():
        return None
    ckpt = read_checkpoint(resume_path, map_location)
    if checkpoint_kind(ckpt) != "minimind_resume":
        raise CheckpointError(f"{resume_path}: not a MiniMind resume checkpoint (missing {', '.join(k for k in MINIMIND_KEYS if k not in ckpt)})")
    saved = int(ckpt.get("world_size") or 1)
    current = current_world_size() if world_size is None else world_size
    if saved != current:
        new_step = corrected_step(int(ckpt["step"]), saved, current)
        log.warning(f"world size changed ({saved}→{current}): step {ckpt['step']} → {new_step}")
        ckpt["step"] = new_step
    return ckpt


# ----------------------------------------------------------------------------- guards

SHAPE_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "use_moe",
                "num_experts", "vocab_size")


def shape_config(state_dict: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """The model-shape fields implied by a MiniMind state dict (any key prefix)."""
    def find(suffix: str) -> torch.Tensor | None:
        return next((v for k, v in state_dict.items() if k.endswith(suffix)), None)

    embed = find("embed_tokens.weight")
    if embed is None:
        return {}
    head_dim = find("layers.0.self_attn.q_norm.weight").shape[0]
    layers = {int(k.split("layers.")[1].split(".")[0]) for k in state_dict if "layers." in k}
    experts = {int(k.split("experts.")[1].split(".")[0]) for k in state_dict if ".mlp.experts." in k and "layers.0." in k}
    return {
        "hidden_size": int(embed.shape[1]),
        "num_hidden_layers": len(layers),
        "num_attention_heads": int(find("layers.0.self_attn.q_proj.weight").shape[0] // head_dim),
        "num_key_value_heads": int(find("layers.0.self_attn.k_proj.weight").shape[0] // head_dim),
        "use_moe": bool(experts),
        "num_experts": len(experts) if experts else None,
        "vocab_size": int(embed.shape[0]),
    }


def config_mismatches(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """``field: checkpoint X, this run Y`` for every shape field that differs."""
    out = []
    for field in SHAPE_FIELDS:
        if field == "num_experts" and not (saved.get("use_moe") and current.get("use_moe")):
            continue
        if field in saved and field in current and saved[field] != current[field]:
            out.append(f"{field}: checkpoint {saved[field]}, this run {current[field]}")
    return out
