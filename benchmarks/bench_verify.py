"""Verifying a checkpoint without a manifest: ``verify_file`` vs a plain read + CRC-32 of the file.

A ~500 MB ``torch.save`` file shaped like a resume checkpoint (fp16 weights, AdamW moments in
fp32, step counters: ~200 records of 2 KiB to 8 MiB, random values) is written to a temporary
directory in the cache dir and deleted afterwards. Each repetition times, in rotated order:

* ``read only`` - ``readinto`` the whole file through a 1 MiB buffer: the I/O floor;
* ``readinto + zlib.crc32`` - the fastest plain check: one CRC-32 of the whole file, read through
  one reused 1 MiB buffer: **the baseline**;
* ``read + zlib.crc32`` - the same as checking a manifest does it (``checkpoint.verify_manifest``:
  ``f.read(4 MiB)``, a new buffer per read);
* ``zipfile.testzip`` - the standard library's check: every record's CRC-32, no structure;
* ``verify_file`` - ours: every record's CRC-32 and every other byte of the zip structure, in one
  pass over the file.

``hot``: the file in the page cache (as right after a save, or a second look). ``cold``: its pages
dropped first (``posix_fadvise(POSIX_FADV_DONTNEED)``, no root needed), so it comes from the disk.
Also reported: the bytes ``verify_file`` reads (``/proc/self/io``), to show the single pass, and
``zlib.crc32`` alone on an in-memory buffer.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import alternating, bench_main, cache_dir, pyplot, rel, save_figure, stats, table

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


def read_only(path: Path) -> None:
    buf = bytearray(1 << 20)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass


def readinto_crc32(path: Path) -> int:
    crc = 0
    buf = bytearray(1 << 20)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
    return crc


def read_crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            crc = zlib.crc32(chunk, crc)
    return crc


def testzip(path: Path) -> None:
    with zipfile.ZipFile(path) as z:
        bad = z.testzip()
    if bad is not None:
        raise RuntimeError(f"zipfile.testzip: {bad} is corrupted")


def verify(path: Path) -> None:
    from lit_minimind.checkpoint.verify import verify_file

    verify_file(path)


VARIANTS: dict[str, Callable[[Path], Any]] = {"read only": read_only, BASELINE: readinto_crc32,
                                              "read + zlib.crc32": read_crc32, "zipfile.testzip": testzip,
                                              OURS: verify}
COLD_VARIANTS = ("read only", BASELINE, "read + zlib.crc32", OURS)


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def bytes_read(fn: Callable[[], Any]) -> int | None:
    """Bytes the process read (``rchar`` of ``/proc/self/io``) while ``fn`` ran; None where unavailable."""
    def rchar() -> int | None:
        try:
            return int(next(line for line in Path("/proc/self/io").read_text().splitlines()
                            if line.startswith("rchar:")).split()[1])
        except (OSError, StopIteration, ValueError):
            return None
    before = rchar()
    fn()
    after = rchar()
    return after - before if before is not None and after is not None else None


def crc32_in_memory(mib: int) -> dict[str, float]:
    """GB/s of ``zlib.crc32`` alone (best of 3): on a 1 MiB buffer (in cache) and on ``mib`` MiB."""
    out = {}
    for size in (1 << 20, mib << 20):
        buf = os.urandom(size)
        repeat = max(1, (64 << 20) // size)
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            for _ in range(repeat):
                zlib.crc32(buf)
            best = min(best, time.perf_counter() - t)
        out[f"{size >> 20} MiB buffer"] = size * repeat / best / 1e9
    return out


def measure(path: Path, size: int, reps: int) -> dict[str, Any]:
    runs: dict[str, dict[str, list[float]]] = {"hot": {k: [] for k in VARIANTS},
                                               "cold": {k: [] for k in COLD_VARIANTS}}
    ratios: dict[str, dict[str, list[float]]] = {"hot": {k: [] for k in VARIANTS},
                                                 "cold": {k: [] for k in COLD_VARIANTS}}
    for fn in VARIANTS.values():  # warm-up, and the file in the page cache
        fn(path)
    for rep in range(reps):
        for cache, names in (("hot", list(VARIANTS)), ("cold", list(COLD_VARIANTS))):
            seconds = {}
            for name in alternating(names, rep):
                if cache == "cold":
                    drop_cache(path)
                t = time.perf_counter()
                VARIANTS[name](path)
                seconds[name] = time.perf_counter() - t
                runs[cache][name].append(seconds[name])
            for name in names:  # > 1: faster than the baseline, within this repetition
                ratios[cache][name].append(seconds[BASELINE] / seconds[name])
    results = {cache: {name: {"s": stats(v), "gb_per_s": stats([size / s / 1e9 for s in v]),
                              "speed_vs_baseline": stats(ratios[cache][name])}
                       for name, v in by_name.items()} for cache, by_name in runs.items()}
    return {"results": results, "baseline": BASELINE,
            "speed_ratio_verify_vs_baseline": {c: results[c][OURS]["speed_vs_baseline"] for c in results}}


def render(payload: dict[str, Any]) -> str:
    rows = []
    for cache in ("hot", "cold"):
        for name, r in payload["results"][cache].items():
            g, s, q = r["gb_per_s"], r["s"], r["speed_vs_baseline"]
            ratio = f"{q['median']:.2f} ({q['min']:.2f}–{q['max']:.2f})"
            rows.append([cache, f"**{name}**" if name == OURS else name,
                         f"{g['median']:.2f} ({g['min']:.2f}–{g['max']:.2f})", f"{s['median']:.3f}",
                         "1 (baseline)" if name == BASELINE else f"**{ratio}**" if name == OURS else ratio])
    return table(["page cache", "variant", "GB/s med (min–max)", "s med", f"speed vs {BASELINE} med (min–max)"], rows)


def plot(payload: dict[str, Any], path: Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 2.8))
    labels, med, err, colors = [], [], [[], []], []
    for cache, color in (("hot", "tab:blue"), ("cold", "tab:gray")):
        for name, r in payload["results"][cache].items():
            g = r["gb_per_s"]
            labels.append(f"{name} ({cache})")
            med.append(g["median"])
            err[0].append(g["median"] - g["min"])
            err[1].append(g["max"] - g["median"])
            colors.append("tab:orange" if name == OURS else color)
    ax.barh(range(len(labels)), med, xerr=err, capsize=2, color=colors)
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("GB/s (median, min–max)")
    ax.set_title(f"checking a {payload['file_bytes'] / 1e6:.0f} MB checkpoint")
    return save_figure(fig, path)


def run(quick: bool = False, reps: int | None = None) -> dict[str, Any]:
    from lit_minimind.checkpoint.verify import CHUNK_SIZE

    reps = reps or (2 if quick else 5)
    with tempfile.TemporaryDirectory(prefix="bench-verify-", dir=cache_dir()) as tmp:
        path = Path(tmp) / "resume.pth"
        shape = write_checkpoint(path, QUICK_MB if quick else FULL_MB)
        measured = measure(path, shape["bytes"], reps)
        read_by_verify = bytes_read(lambda: verify(path))
    payload = {"reps": reps, "disk_dir": rel(cache_dir()), "file_bytes": shape["bytes"], "records": shape["records"],
               "chunk_size": CHUNK_SIZE, **measured, "verify_bytes_read": read_by_verify,
               "crc32_in_memory_gb_per_s": crc32_in_memory(8 if quick else 64)}
    return {**payload, "table": render(payload)}


if __name__ == "__main__":
    raise SystemExit(bench_main(sys.modules[__name__]))
