"""Data set-up at MiniMind's size: the record index's first build and cached start vs MiniMind's loader.

A seeded 1,270,238-record ``{"text"}`` file (~1.2 GB, like ``pretrain_t2t_mini.jsonl``; ``--records N``) in the page
cache; each number from a fresh process: ``MiniMindDataModule.setup()`` with an empty cache (the index built, every
line validated) and cached (3 next starts, target <= 0.5 s), two processes at once on one cache, ``train_dataloader()``
samples/s with 0 and 2 workers; MiniMind's ``load_dataset('json')`` into a fresh and a warm Arrow cache, alternating
with ours, where a Python with ``datasets`` is at hand (``--minimind-python``, ``$MINIMIND_PYTHON`` or this one).
Peak RSS: high-water mark minus RSS before the set-up.
"""

from __future__ import annotations

import json
import os
import resource
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
        (["--minimind-python"], {"default": None, "dest": "mm_python", "help": "a Python with `datasets`"})]


def cpu_s() -> float:
    """CPU seconds of this process and its reaped children (the index's scan workers)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def probe(mode: str, data: str, cache: str, tokenizer: str, workers: int = 0, batches: int = 0) -> dict[str, Any]:
    """One measurement in this (fresh) process, after its imports: ``minimind`` (``load_dataset``), ``setup`` or
    ``loader`` (``setup`` then ``batches`` of the train dataloader)."""
    if mode == "minimind":
        from datasets import load_dataset  # MiniMind's PretrainDataset: load_dataset('json', ...)

        setup = lambda: len(load_dataset("json", data_files=data, split="train", cache_dir=cache))
    else:
        import torch

        torch.set_num_threads(1)
        from lit_minimind.data.datamodule import MiniMindDataModule

        dm = MiniMindDataModule(data_path=data, tokenizer_path=tokenizer, cache_dir=cache, max_seq_len=340,
                                batch_size=32, num_workers=workers)
        setup = lambda: dm.setup("fit") or len(dm.train_dataset)
    before, cpu, start = bc.proc_field("status", "VmRSS"), cpu_s(), time.perf_counter()
    records = setup()
    out: dict[str, Any] = {"setup_s": time.perf_counter() - start, "cpu_s": cpu_s() - cpu, "records": records,
                           "peak_rss_mib": (bc.proc_field("status", "VmHWM") - before) / 1024}
    if mode == "loader":
        it = iter(dm.train_dataloader())
        next(it)  # worker start-up and the first batch outside the timed window
        start = time.perf_counter()
        for _ in range(batches):
            next(it)
        out["samples_per_s"] = batches * 32 / (time.perf_counter() - start)
    return out


def probes(python: str, mode: str, data: Path, cache: Path, tokenizer: Path, workers: int = 0, batches: int = 0,
           at_once: int = 1) -> list[dict[str, Any]]:
    """:func:`probe` in ``at_once`` fresh processes started together (the ranks of a node): each one's result, and
    whether it built the index (its ``indexed`` line)."""
    args = [mode, str(data), str(cache), str(tokenizer), workers, batches]
    cmd = [python, "-c", f"import json; from benchmarks.bench_data import probe; print(json.dumps(probe(*{args!r})))"]
    env = bc.child_env(OMP_NUM_THREADS="1")
    with ThreadPoolExecutor(at_once) as pool:
        runs = list(pool.map(lambda _: bc.launch(cmd, cache.parent, env=env, timeout=1800), range(at_once)))
    return [{**json.loads(next(line for _, line in reversed(r["lines"]) if line.startswith("{"))),
             "built": sum("lit_minimind: indexed " in line for _, line in r["lines"])} for r in runs]


def measure(data: Path, tokenizer: Path, work: Path, reps: int, mm_python: str | None, batches: int,
            next_reps: int) -> dict[str, Any]:
    py, first, mm_first, mm_cache = sys.executable, [], [], work / f"cache-minimind-{reps - 1}"
    for rep in range(reps):
        for side in bc.alternating(["ours"] + (["minimind"] if mm_python else []), rep):
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
    mm_cached = [probes(mm_python, "minimind", data, mm_cache, tokenizer)[0]
                 for _ in range(next_reps if mm_python else 0)]
    shutil.rmtree(mm_cache, ignore_errors=True)
    ddp_cold, ddp_cached = (probes(py, "setup", data, work / "cache-ddp", tokenizer, at_once=2) for _ in range(2))
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
        "index_bytes": sum(p.stat().st_size for p in (keep / "index").glob("*.npy")), "records": first[0]["records"]}
    if mm_python:
        out["minimind"] = {"python": mm_python, "first_load": bc.stats([r["setup_s"] for r in mm_first]),
                           "first_load_cpu": bc.stats([r["cpu_s"] for r in mm_first]),
                           "cached_load": bc.stats([r["setup_s"] for r in mm_cached]),
                           "peak_rss_mib": max(r["peak_rss_mib"] for r in mm_first + mm_cached)}
        out["first_build_vs_minimind"] = bc.stats([o["setup_s"] / m["setup_s"] for o, m in zip(first, mm_first)])
    return out


def render(p: dict[str, Any]) -> str:
    mm, ddp, na = p.get("minimind"), p["ddp2"], "n/a (no `datasets`)"
    theirs = lambda key: bc.spread(mm[key]) if mm else na
    rows = [["first start (s; ours: index built, every line validated)", bc.spread(p["first_build"]),
             theirs("first_load")],
            ["first start, CPU s (all threads and processes)", bc.spread(p["first_build_cpu"]),
             theirs("first_load_cpu")],
            ["next start (s; a resume)", f"**{bc.spread(p['cached_start'])}**", theirs("cached_load")],
            ["peak RSS of the set-up (MiB; first / next start)",
             f"{p['first_build_peak_rss_mib']:.0f} / {p['cached_start_peak_rss_mib']:.0f}",
             f"{mm['peak_rss_mib']:.0f} (max)" if mm else na],
            ["DDP 2, each rank's set-up (s): cold / cached", ", ".join(f"{s:.2f}" for s in ddp["cold_s"]) + " / "
             + ", ".join(f"{s:.3f}" for s in ddp["cached_s"]), ""],
            ["DDP 2, index builds: cold / cached", f"{ddp['cold_builds']} / {ddp['cached_builds']}", ""],
            ["loader samples/s, 0 / 2 workers (batch 32, seq 340)",
             " / ".join(f"{p['loader_samples_per_s'][w]:,.0f}" for w in ("0", "2")), ""],
            ["index on disk", f"{p['index_bytes']:,} bytes ({p['index_bytes'] / p['records']:.0f} per record)",
             "an Arrow copy of the data" if mm else ""]]
    return bc.table(["", "lit-minimind", "MiniMind (`load_dataset('json')`)"], rows)


def plot(p: dict[str, Any], path: Path) -> Path:
    rows = [("ours: first", p["first_build"], "tab:orange"), ("ours: next", p["cached_start"], "tab:orange")]
    if mm := p.get("minimind"):
        rows += [("MiniMind: first", mm["first_load"], "tab:gray"), ("MiniMind: next", mm["cached_load"], "tab:gray")]
    title = f"{p['records']:,} records, {p['data_bytes'] / 1e9:.2f} GB"
    return bc.chart(path, (title, "data set-up, s (median, min–max)", rows), width=7)


def run(quick: bool = False, reps: int | None = None, records: int | None = None,
        mm_python: str | None = None) -> dict[str, Any]:
    records, reps = records or (QUICK_RECORDS if quick else FULL_RECORDS), reps or (1 if quick else 3)
    mm = bc.python_with("datasets", mm_python, os.environ.get("MINIMIND_PYTHON"), sys.executable)
    _, tokenizer = bc.default_data()
    bc.say(f"  {records:,} records; MiniMind's loader: {mm or 'skipped (no Python with `datasets`)'}")
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        data, start = Path(tmp) / "pretrain_t2t_mini.jsonl", time.perf_counter()
        size = bc.synthetic_jsonl(records, 600, 1100, path=data).stat().st_size  # MiniMind's pretraining records
        bc.say(f"  generated {size / 1e9:.2f} GB in {time.perf_counter() - start:.0f} s")
        measured = measure(data, tokenizer, Path(tmp), reps, mm, 20 if quick else 200, 1 if quick else 3)
    payload = {"reps": reps, "data_bytes": size, **measured, "first_build_s": measured["first_build"]["median"],
               "cached_start_s": measured["cached_start"]["median"], "cached_start_target_s": CACHED_TARGET_S,
               "cached_start_target_met": measured["cached_start"]["max"] <= CACHED_TARGET_S}
    return {**payload, "table": render(payload)}


if __name__ == "__main__":
    from benchmarks.run_all import main
    raise SystemExit(main(alone=NAME))
