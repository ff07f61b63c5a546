"""Verifying a checkpoint without a manifest: ``verify_file`` vs a plain read + CRC-32 of the file.

A ~500 MB resume-shaped ``torch.save`` file (random values) in the cache dir; rotated after a warm-up: ``read only``
(``readinto`` a 1 MiB buffer), ``readinto + zlib.crc32`` (one CRC-32 of the file, what a manifest check needs: **the
baseline**), ``read + zlib.crc32`` (as ``verify_manifest`` reads), ``zipfile.testzip`` (every record's CRC-32) and
``verify_file`` (every record's CRC-32 and every other byte of the zip structure); speed = baseline time / variant
time within a repetition; ``cold``: after ``posix_fadvise(DONTNEED)``. Also: the bytes ``verify_file`` reads, and
``zlib.crc32`` alone in memory.
"""

from __future__ import annotations

import os
import timeit
import zipfile
import zlib
from pathlib import Path
from typing import Any

from benchmarks import common as bc
from lit_minimind.checkpoint.read import CHUNK_SIZE, verify_file

NAME = "verify"
BASELINE, OURS = "readinto + zlib.crc32", "verify_file"


def write_checkpoint(path: Path, megabytes: int) -> dict[str, int]:
    """A resume-shaped checkpoint of about ``megabytes`` MB: 10 bytes per parameter (fp16 + 2 x fp32), 24 layers."""
    import torch

    g = torch.Generator().manual_seed(0)
    big = max(1, megabytes * 10**6 // 10 // 24 - 1024)
    shapes = {f"model.layers.{i}.{name}": shape for i in range(24)
              for name, shape in (("mlp.weight", (big,)), ("norm.weight", (1024,)))}
    state = {i: {"step": torch.tensor(100.0), "exp_avg": torch.randn(s, generator=g),
                 "exp_avg_sq": torch.rand(s, generator=g)} for i, s in enumerate(shapes.values())}
    groups = [{"lr": 5e-4, "betas": (0.9, 0.95), "weight_decay": 0.1, "params": list(range(len(shapes)))}]
    torch.save({"model": {k: torch.randn(s, generator=g).half() for k, s in shapes.items()}, "epoch": 0, "step": 100,
                "optimizer": {"state": state, "param_groups": groups}, "world_size": 1}, path)
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


VARIANTS = {"read only": lambda p: readinto_crc32(p, crc=False), BASELINE: readinto_crc32,
            "read + zlib.crc32": read_crc32, "zipfile.testzip": testzip, OURS: verify_file}
CACHES = {"hot": list(VARIANTS), "cold": ["read only", BASELINE, "read + zlib.crc32", OURS]}


def timed(name: str, path: Path, cold: bool) -> float:
    """Seconds of one variant; ``cold``: the file dropped from the page cache first."""
    if cold:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    return timeit.timeit(lambda: VARIANTS[name](path), number=1)


def bytes_read(path: Path) -> int | None:
    """Bytes the process read (``rchar`` of ``/proc/self/io``) while ``verify_file`` ran; None where unavailable."""
    if not os.path.exists("/proc/self/io"):
        return None
    before = bc.proc_field("io", "rchar")
    verify_file(path)
    return bc.proc_field("io", "rchar") - before


def measure(path: Path, size: int, reps: int) -> dict[str, Any]:
    for fn in VARIANTS.values():  # warm-up, and the file in the page cache
        fn(path)
    results = {}
    for cache, names in CACHES.items():  # speed > 1: faster than the baseline, within a repetition
        runs = bc.rotated(names, reps, lambda name: timed(name, path, cache == "cold"))
        results[cache] = {name: {"s": bc.stats(v), "gb_per_s": bc.stats([size / s / 1e9 for s in v]),
                                 "speed_vs_baseline": bc.ratios(runs[BASELINE], v)} for name, v in runs.items()}
    return {"results": results, "baseline": BASELINE,
            "speed_ratio_verify_vs_baseline": {c: results[c][OURS]["speed_vs_baseline"] for c in results}}


def render(payload: dict[str, Any]) -> str:
    bold = lambda name, text: f"**{text}**" if name == OURS else text
    rows = [[cache, bold(name, name), bc.spread(r["gb_per_s"], 2), f"{r['s']['median']:.3f}",
             "1 (baseline)" if name == BASELINE else bold(name, bc.spread(r["speed_vs_baseline"], 2))]
            for cache in CACHES for name, r in payload["results"][cache].items()]
    return bc.table(["page cache", "variant", "GB/s med (min–max)", "s med", f"speed vs {BASELINE} med (min–max)"],
                    rows)


def plot(p: dict[str, Any], path: Path) -> Path:
    color = lambda name, cache: "tab:orange" if name == OURS else "tab:blue" if cache == "hot" else "tab:gray"
    rows = [(f"{name} ({cache})", r["gb_per_s"], color(name, cache))
            for cache in CACHES for name, r in p["results"][cache].items()]
    return bc.chart(path, (f"checking a {p['file_bytes'] / 1e6:.0f} MB checkpoint", "GB/s (median, min–max)", rows),
                    width=8)


def run(quick: bool = False, reps: int | None = None) -> dict[str, Any]:
    reps = reps or (2 if quick else 5)
    with bc.workdir("verify") as tmp:
        path = tmp / "resume.pth"
        shape = write_checkpoint(path, 8 if quick else 500)
        measured, read = measure(path, shape["bytes"], reps), bytes_read(path)
    crc = {k: v for k, v in bc.byte_rates(8 if quick else 64).items() if k.startswith("crc32")}
    verdict = (f"`verify_file` read {read:,} bytes of the {shape['bytes']:,}-byte file ({shape['records']} records); "
               if read is not None else "") + "`zlib.crc32` alone in memory: " + ", ".join(
                   f"{k.removeprefix('crc32 (zlib), ')} {v:.2f} GB/s" for k, v in crc.items()) + "."
    payload = {"reps": reps, "disk_dir": bc.rel(bc.cache_dir()), "file_bytes": shape["bytes"],
               "records": shape["records"], "chunk_size": CHUNK_SIZE, **measured, "verify_bytes_read": read,
               "crc32_in_memory_gb_per_s": crc}
    return {**payload, "table": render(payload), "verdict": verdict}


if __name__ == "__main__":
    from benchmarks.run_all import main
    raise SystemExit(main(alone=NAME))
