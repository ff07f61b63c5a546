"""Data set-up at MiniMind's size: the record index's first build and cached start vs MiniMind's loader.

A seeded 1,270,238-record ``{"text"}`` file (~1.2 GB, like ``pretrain_t2t_mini.jsonl``; ``--records N``) in a temporary
directory (``--dir``), in the page cache; every number from a fresh process (:func:`probe`): ``MiniMindDataModule.setup()``
with an empty cache (the index built, every line validated) and with the index cached; two processes at once on one
cache (a node's ranks: set-up times, how many built the index); ``train_dataloader()`` samples/s with 0 and 2 workers;
MiniMind's ``datasets.load_dataset('json')`` into a fresh and a warm Arrow cache, where a Python with ``datasets`` is at
hand (this one, ``--minimind-python``, ``$MINIMIND_PYTHON``), alternating with ours. Peak RSS: high-water mark minus RSS
before the set-up.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks import common as bc

NAME = "data"
FULL_RECORDS, QUICK_RECORDS, CACHED_TARGET_S = 1_270_238, 5_000, 0.5
ARGS = [(["--records"], {"type": int, "default": None, "help": f"records in the file (default {FULL_RECORDS:,})"}),
        (["--dir"], {"type": Path, "default": None, "dest": "directory", "help": "where the file goes (default: the system's temp dir)"}),
        (["--minimind-python"], {"default": None, "dest": "mm_python", "help": "a Python with `datasets` for MiniMind's loader"})]


# ----------------------------------------------------------------------------- probes (fresh processes)


def _cpu_s() -> float:
    """CPU seconds of this process and its reaped children (the index's scan workers)."""
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def probe(mode: str, data: str, cache: str, tokenizer: str, workers: int = 0, batches: int = 0) -> dict[str, Any]:
    """One measurement in this (fresh) process; returns what it measured."""
    if mode == "minimind":
        from datasets import load_dataset  # MiniMind's PretrainDataset: load_dataset('json', ...)

        before, cpu = _rss_kib("VmRSS"), _cpu_s()
        start = time.perf_counter()
        ds = load_dataset("json", data_files=data, split="train", cache_dir=cache)
        seconds = time.perf_counter() - start
        return {"setup_s": seconds, "cpu_s": _cpu_s() - cpu, "records": len(ds),
                "peak_rss_mib": (_rss_kib("VmHWM") - before) / 1024}
    import torch

    torch.set_num_threads(1)
    from lit_minimind.data.datamodule import MiniMindDataModule

    dm = MiniMindDataModule(data_path=data, tokenizer_path=tokenizer, cache_dir=cache, max_seq_len=340,
                            batch_size=32, num_workers=workers)
    before, cpu = _rss_kib("VmRSS"), _cpu_s()
    start = time.perf_counter()
    dm.setup("fit")
    out: dict[str, Any] = {"setup_s": time.perf_counter() - start, "cpu_s": _cpu_s() - cpu, "records": len(dm.train_dataset),
                           "peak_rss_mib": (_rss_kib("VmHWM") - before) / 1024}
    if mode == "loader":
        it = iter(dm.train_dataloader())
        next(it)  # worker start-up and the first batch outside the timed window
        start = time.perf_counter()
        for _ in range(batches):
            next(it)
        out["samples_per_s"] = batches * 32 / (time.perf_counter() - start)
        del it
    return out


def probes(python: str, mode: str, data: Path, cache: Path, tokenizer: Path, workers: int = 0, batches: int = 0,
           at_once: int = 1) -> list[dict[str, Any]]:
    """:func:`probe` in ``at_once`` fresh processes started together (the ranks of a node): each one's result, and
    whether it built the index (its ``indexed`` line)."""
    args = [mode, str(data), str(cache), str(tokenizer), workers, batches]
    cmd = [python, "-c", f"import json; from benchmarks.bench_data import probe; print(json.dumps(probe(*{args!r})))"]
    with ThreadPoolExecutor(at_once) as pool:
        runs = list(pool.map(lambda _: bc.launch(cmd, cache.parent, env=bc.child_env(OMP_NUM_THREADS="1"), timeout=1800), range(at_once)))
    return [{**json.loads(next(line for _, line in reversed(r["lines"]) if line.startswith("{"))),
             "built": sum("lit_minimind: indexed " in line for _, line in r["lines"])} for r in runs]


def minimind_python(explicit: str | None) -> str | None:
    """A Python that can import ``datasets``: ``explicit``, ``$MINIMIND_PYTHON`` or this one; else None."""
    for candidate in (explicit, os.environ.get("MINIMIND_PYTHON"), sys.executable):
        if candidate and bc.launch([candidate, "-c", "import datasets"], Path.cwd(), check=False)["returncode"] == 0:
            return candidate
    return None


# ----------------------------------------------------------------------------- the benchmark


def measure(data: Path, tokenizer: Path, work: Path, reps: int, mm_python: str | None, batches: int,
            next_reps: int) -> dict[str, Any]:
    py = sys.executable
    first: list[dict[str, Any]] = []
    mm_first: list[dict[str, Any]] = []
    sides = ["ours"] + (["minimind"] if mm_python else [])
    for rep in range(reps):
        for side in bc.alternating(sides, rep):
            cache = work / f"cache-{side}-{rep}"
            if side == "ours":
                first.append(probes(py, "setup", data, cache, tokenizer)[0])
                keep = cache
            else:
                mm_first.append(probes(mm_python, "minimind", data, cache, tokenizer)[0])
                if rep < reps - 1:
                    shutil.rmtree(cache, ignore_errors=True)  # MiniMind's Arrow copy: the file's size
        bc.say(f"  rep {rep + 1}: first build {first[-1]['setup_s']:.2f} s"
            + (f", MiniMind's first load {mm_first[-1]['setup_s']:.2f} s" if mm_first else ""))
    cached = [probes(py, "setup", data, keep, tokenizer)[0] for _ in range(next_reps)]
    mm_cached = [probes(mm_python, "minimind", data, work / f"cache-minimind-{reps - 1}", tokenizer)[0]
                 for _ in range(next_reps)] if mm_python else []
    shutil.rmtree(work / f"cache-minimind-{reps - 1}", ignore_errors=True)
    ddp_cold = probes(py, "setup", data, work / "cache-ddp", tokenizer, at_once=2)
    ddp_cached = probes(py, "setup", data, work / "cache-ddp", tokenizer, at_once=2)
    loader = {w: probes(py, "loader", data, keep, tokenizer, workers=w, batches=batches)[0] for w in (0, 2)}
    out: dict[str, Any] = {
        "first_build": bc.stats([r["setup_s"] for r in first]),
        "first_build_cpu": bc.stats([r["cpu_s"] for r in first]),
        "cached_start": bc.stats([r["setup_s"] for r in cached]),
        "first_build_peak_rss_mib": max(r["peak_rss_mib"] for r in first),
        "cached_start_peak_rss_mib": max(r["peak_rss_mib"] for r in cached),
        "builds_first": [r["built"] for r in first], "builds_cached": [r["built"] for r in cached],
        "ddp2": {"cold_s": [r["setup_s"] for r in ddp_cold], "cold_builds": sum(r["built"] for r in ddp_cold),
                 "cached_s": [r["setup_s"] for r in ddp_cached], "cached_builds": sum(r["built"] for r in ddp_cached)},
        "loader_samples_per_s": {str(w): r["samples_per_s"] for w, r in loader.items()},
        "index_bytes": sum(p.stat().st_size for p in (keep / "index").glob("*.npy")),
        "records": first[0]["records"],
    }
    if mm_python:
        out["minimind"] = {"python": mm_python, "first_load": bc.stats([r["setup_s"] for r in mm_first]),
                           "first_load_cpu": bc.stats([r["cpu_s"] for r in mm_first]),
                           "cached_load": bc.stats([r["setup_s"] for r in mm_cached]),
                           "peak_rss_mib": max(r["peak_rss_mib"] for r in mm_first + mm_cached)}
        out["first_build_vs_minimind"] = bc.stats([o["setup_s"] / m["setup_s"] for o, m in zip(first, mm_first)])
    return out


def render(p: dict[str, Any]) -> str:
    mm = p.get("minimind")
    na = "n/a (no `datasets`)"
    fmt = lambda s: f"{s['median']:.3f} ({s['min']:.3f}–{s['max']:.3f})"
    ddp = p["ddp2"]
    rows = [
        ["first start (s; ours: index built, every line validated)", fmt(p["first_build"]),
         fmt(mm["first_load"]) if mm else na],
        ["first start, CPU s (all threads and processes)", fmt(p["first_build_cpu"]),
         fmt(mm["first_load_cpu"]) if mm else na],
        ["next start (s; a resume)", f"**{fmt(p['cached_start'])}**", fmt(mm["cached_load"]) if mm else na],
        ["peak RSS of the set-up (MiB; first / next start)",
         f"{p['first_build_peak_rss_mib']:.0f} / {p['cached_start_peak_rss_mib']:.0f}",
         f"{mm['peak_rss_mib']:.0f} (max)" if mm else na],
        ["DDP 2, each rank's set-up (s): cold / cached", " / ".join(
            [", ".join(f"{s:.2f}" for s in ddp["cold_s"]), ", ".join(f"{s:.3f}" for s in ddp["cached_s"])]), ""],
        ["DDP 2, index builds: cold / cached", f"{ddp['cold_builds']} / {ddp['cached_builds']}", ""],
        ["loader samples/s, 0 / 2 workers (batch 32, seq 340)",
         " / ".join(f"{p['loader_samples_per_s'][w]:,.0f}" for w in ("0", "2")), ""],
        ["index on disk", f"{p['index_bytes']:,} bytes ({p['index_bytes'] / p['records']:.0f} per record)",
         "an Arrow copy of the data" if mm else ""],
    ]
    return bc.table(["", "lit-minimind", "MiniMind (`load_dataset('json')`)"], rows)


def plot(p: dict[str, Any], path: Path) -> Path:
    plt = bc.pyplot()
    fig, ax = plt.subplots(figsize=(7, 2.4))
    labels = ["ours: first", "ours: next"]
    values = [p["first_build"]["median"], p["cached_start"]["median"]]
    if p.get("minimind"):
        labels += ["MiniMind: first", "MiniMind: next"]
        values += [p["minimind"]["first_load"]["median"], p["minimind"]["cached_load"]["median"]]
    ax.barh(range(len(labels)), values, color=["tab:orange", "tab:orange", "tab:gray", "tab:gray"][: len(labels)])
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("data set-up, s (median)")
    ax.set_title(f"{p['records']:,} records, {p['data_bytes'] / 1e9:.2f} GB")
    return bc.save_figure(fig, path)


def run(quick: bool = False, reps: int | None = None, records: int | None = None, directory: Path | None = None,
        mm_python: str | None = None) -> dict[str, Any]:
    records, reps = records or (QUICK_RECORDS if quick else FULL_RECORDS), reps or (1 if quick else 3)
    mm = minimind_python(mm_python)
    _, tokenizer = bc.default_data()
    bc.say(f"  {records:,} records; MiniMind's loader: {mm or 'skipped (no Python with `datasets`; --minimind-python)'}")
    with tempfile.TemporaryDirectory(prefix="bench-data-", dir=directory) as tmp:
        data, start = Path(tmp) / "pretrain_t2t_mini.jsonl", time.perf_counter()
        size = bc.synthetic_jsonl(records, 600, 1100, path=data).stat().st_size  # MiniMind's pretraining records
        bc.say(f"  generated {size / 1e9:.2f} GB in {time.perf_counter() - start:.0f} s")
        measured = measure(data, tokenizer, Path(tmp), reps, mm, 20 if quick else 200, 1 if quick else 3)
    payload = {"reps": reps, "data_bytes": size, **measured, "first_build_s": measured["first_build"]["median"],
               "cached_start_s": measured["cached_start"]["median"], "cached_start_target_s": CACHED_TARGET_S,
               "cached_start_target_met": measured["cached_start"]["max"] <= CACHED_TARGET_S}
    return {**payload, "table": render(payload)}


if __name__ == "__main__":
    raise SystemExit(bc.bench_main(sys.modules[__name__]))
