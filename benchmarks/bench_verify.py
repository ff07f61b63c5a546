"""Verifying a checkpoint without a manifest: ``verify_file`` vs a plain read + CRC-32 of the file.

A ~500 MB resume-shaped ``torch.save`` file (fp16 weights, fp32 AdamW moments: ~200 records, random values) in the
cache dir; each repetition times, rotated: ``read only`` (``readinto`` a 1 MiB buffer: the I/O floor), ``readinto +
zlib.crc32`` (one CRC-32 of the file: **the baseline**), ``read + zlib.crc32`` (as a manifest check reads), ``zipfile.testzip``
(every record's CRC-32) and ``verify_file`` (every record's CRC-32 and every other byte of the zip structure, one pass);
``hot`` in the page cache, ``cold`` after ``posix_fadvise(DONTNEED)``. Also: the bytes ``verify_file`` reads
(``/proc/self/io``) and ``zlib.crc32`` alone in memory.
"""

from __future__ import annotations

import os
import sys
import tempfile
import timeit
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import common as bc

NAME = "verify"
FULL_MB, QUICK_MB = 500, 8
BASELINE = "readinto + zlib.crc32"
OURS = "verify_file"


def write_checkpoint(path: Path, megabytes: int) -> dict[str, int]:
    """A resume-shaped checkpoint of about ``megabytes`` MB: 10 bytes per parameter (fp16 + 2 x fp32)."""
    import torch

    g = torch.Generator().manual_seed(0)
    params = megabytes * 10**6 // 10
    layers = 24
    big = max(1, params // layers - 1024)
    shapes = {f"model.layers.{i}.{name}": shape for i in range(layers)
              for name, shape in (("mlp.weight", (big,)), ("norm.weight", (1024,)))}
    model = {k: torch.randn(s, generator=g).half() for k, s in shapes.items()}
    state = {i: {"step": torch.tensor(100.0), "exp_avg": torch.randn(s, generator=g),
                 "exp_avg_sq": torch.rand(s, generator=g)} for i, s in enumerate(shapes.values())}
    optimizer = {"state": state, "param_groups": [{"lr": 5e-4, "betas": (0.9, 0.95), "weight_decay": 0.1,
                                                   "params": list(range(len(shapes)))}]}
    torch.save({"model": model, "optimizer": optimizer, "epoch": 0, "step": 100, "world_size": 1}, path)
    with open(path, "rb") as f:
        os.fsync(f.fileno())
    return {"bytes": path.stat().st_size, "records": len(zipfile.ZipFile(path).infolist())}


def readinto_crc32(path: Path, crc: bool = True) -> int:
    """The whole file through one reused 1 MiB buffer (``crc``: one CRC-32 of it, the baseline; else read only)."""
    buf, value = bytearray(1 << 20), 0
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            value = zlib.crc32(view[:n], value) if crc else value
    return value


def read_crc32(path: Path) -> int:
    """As checking a manifest does it (``checkpoint.verify_manifest``): ``f.read(4 MiB)``, a new buffer per read."""
    value = 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            value = zlib.crc32(chunk, value)
    return value


def testzip(path: Path) -> None:
    with zipfile.ZipFile(path) as z:
        if (bad := z.testzip()) is not None:
            raise RuntimeError(f"zipfile.testzip: {bad} is corrupted")


def verify(path: Path) -> None:
    from lit_minimind.checkpoint.verify import verify_file

    verify_file(path)


VARIANTS: dict[str, Callable[[Path], Any]] = {"read only": lambda p: readinto_crc32(p, crc=False), BASELINE: readinto_crc32,
                                              "read + zlib.crc32": read_crc32, "zipfile.testzip": testzip, OURS: verify}
CACHES = {"hot": list(VARIANTS), "cold": ["read only", BASELINE, "read + zlib.crc32", OURS]}


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


def bytes_read(fn: Callable[[], Any]) -> int | None:
    """Bytes the process read (``rchar`` of ``/proc/self/io``) while ``fn`` ran; None where unavailable."""
    rchar = lambda: next((int(line.split()[1]) for line in open("/proc/self/io") if line.startswith("rchar:")), None)  # noqa: E731
    before = rchar() if os.path.exists("/proc/self/io") else None
    fn()
    return rchar() - before if before is not None else None


def crc32_in_memory(mib: int) -> dict[str, float]:
    """GB/s of ``zlib.crc32`` alone (best of 3): on a 1 MiB buffer (in cache) and on ``mib`` MiB."""
    out = {}
    for size in (1 << 20, mib << 20):
        buf, repeat = os.urandom(size), max(1, (64 << 20) // size)
        best = min(timeit.timeit(lambda: zlib.crc32(buf), number=repeat) for _ in range(3))
        out[f"{size >> 20} MiB buffer"] = size * repeat / best / 1e9
    return out


def measure(path: Path, size: int, reps: int) -> dict[str, Any]:
    runs = {cache: {k: [] for k in names} for cache, names in CACHES.items()}
    ratios = {cache: {k: [] for k in names} for cache, names in CACHES.items()}
    for fn in VARIANTS.values():  # warm-up, and the file in the page cache
        fn(path)
    for rep in range(reps):
        for cache, names in CACHES.items():
            seconds = {}
            for name in bc.alternating(names, rep):
                if cache == "cold":
                    drop_cache(path)
                seconds[name] = timeit.timeit(lambda: VARIANTS[name](path), number=1)
                runs[cache][name].append(seconds[name])
            for name in names:  # > 1: faster than the baseline, within this repetition
                ratios[cache][name].append(seconds[BASELINE] / seconds[name])
    results = {cache: {name: {"s": bc.stats(v), "gb_per_s": bc.stats([size / s / 1e9 for s in v]),
                              "speed_vs_baseline": bc.stats(ratios[cache][name])} for name, v in by_name.items()}
               for cache, by_name in runs.items()}
    return {"results": results, "baseline": BASELINE,
            "speed_ratio_verify_vs_baseline": {c: results[c][OURS]["speed_vs_baseline"] for c in results}}


def render(payload: dict[str, Any]) -> str:
    rows = [[cache, f"**{name}**" if name == OURS else name, bc.spread(r["gb_per_s"], 2), f"{r['s']['median']:.3f}",
             "1 (baseline)" if name == BASELINE else f"**{bc.spread(r['speed_vs_baseline'], 2)}**" if name == OURS
             else bc.spread(r["speed_vs_baseline"], 2)] for cache in CACHES for name, r in payload["results"][cache].items()]
    return bc.table(["page cache", "variant", "GB/s med (min–max)", "s med", f"speed vs {BASELINE} med (min–max)"], rows)


def plot(payload: dict[str, Any], path: Path) -> Path:
    fig, ax = bc.pyplot().subplots(figsize=(8, 2.8))
    bars = [(f"{name} ({cache})", r["gb_per_s"], "tab:orange" if name == OURS else {"hot": "tab:blue", "cold": "tab:gray"}[cache])
            for cache in CACHES for name, r in payload["results"][cache].items()]
    ax.barh(range(len(bars)), [g["median"] for _, g, _ in bars], color=[c for _, _, c in bars], capsize=2,
            xerr=[[g["median"] - g["min"] for _, g, _ in bars], [g["max"] - g["median"] for _, g, _ in bars]])
    ax.set_yticks(range(len(bars)), [label for label, _, _ in bars], fontsize=8)
    ax.invert_yaxis()
    ax.set(xlabel="GB/s (median, min–max)", title=f"checking a {payload['file_bytes'] / 1e6:.0f} MB checkpoint")
    return bc.save_figure(fig, path)


def run(quick: bool = False, reps: int | None = None) -> dict[str, Any]:
    from lit_minimind.checkpoint.verify import CHUNK_SIZE

    reps = reps or (2 if quick else 5)
    with tempfile.TemporaryDirectory(prefix="bench-verify-", dir=bc.cache_dir()) as tmp:
        path = Path(tmp) / "resume.pth"
        shape = write_checkpoint(path, QUICK_MB if quick else FULL_MB)
        measured = measure(path, shape["bytes"], reps)
        read_by_verify = bytes_read(lambda: verify(path))
    payload = {"reps": reps, "disk_dir": bc.rel(bc.cache_dir()), "file_bytes": shape["bytes"], "records": shape["records"],
               "chunk_size": CHUNK_SIZE, **measured, "verify_bytes_read": read_by_verify,
               "crc32_in_memory_gb_per_s": crc32_in_memory(8 if quick else 64)}
    return {**payload, "table": render(payload)}


if __name__ == "__main__":
    raise SystemExit(bc.bench_main(sys.modules[__name__]))
