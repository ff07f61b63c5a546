"""Data set-up at MiniMind's size: the record index's first build and cached start vs MiniMind's loader.

A seeded MiniMind-size pretraining file (1,270,238 ``{"text"}`` records of 600-1,100 characters,
~1.2 GB, like ``pretrain_t2t_mini.jsonl``; ``--records N`` for another size) is written to a
temporary directory (``--dir``, default the system's) and deleted afterwards. Every measurement
runs in a fresh process (``--probe``), the file in the page cache:

* ``first build``: ``MiniMindDataModule.setup()`` (kind detection, tokenizer, dataset: the index
  built, every line validated) with an empty cache;
* ``cached start``: the same with the index cached (a resume, a restart);
* ``DDP 2``: two processes started at once on one cache, as the two ranks of a node: each one's
  set-up time and how many built the index (one must), cold and cached;
* ``loader``: samples/s of ``train_dataloader()`` (batch 32, seq 340, the cached index) with 0 and
  2 workers, after its first batch;
* MiniMind: ``datasets.load_dataset('json', data_files=..., split='train')`` (what MiniMind's
  ``PretrainDataset`` runs) into a fresh and then a warm Arrow cache, when a Python with
  ``datasets`` is at hand (this one, or ``--minimind-python`` / ``$MINIMIND_PYTHON``); skipped
  otherwise. Ours and MiniMind's first loads alternate within each repetition.

Peak RSS: the probe process's high-water mark minus its RSS before the set-up (imports excluded).

``python -m benchmarks.bench_data [--quick] [--records N] [--reps N] [--dir DIR] [--minimind-python PY]``
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    RESULTS_DIR,
    ROOT,
    alternating,
    bench_parser,
    default_data,
    environment,
    pyplot,
    save_figure,
    say,
    set_threads,
    stats,
    synthetic_jsonl,
    table,
    write_json,
)

FULL_RECORDS, QUICK_RECORDS = 1_270_238, 5_000
CACHED_TARGET_S = 0.5
def generate(path: Path, records: int, seed: int = 1234) -> int:
    """``records`` seeded ``{"text"}`` lines of 600-1,100 characters (MiniMind's pretraining records);
    returns the file's bytes."""
    return synthetic_jsonl(records, 600, 1100, seed, path=path).stat().st_size


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


def run_probe(python: str, mode: str, data: Path, cache: Path, tokenizer: Path, workers: int = 0,
              batches: int = 0) -> dict[str, Any]:
    cmd = [python, "-m", "benchmarks.bench_data", "--probe", mode, "--data", str(data), "--cache", str(cache),
           "--tokenizer", str(tokenizer), "--workers", str(workers), "--batches", str(batches)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"probe {mode} failed ({proc.returncode}): {proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["built"] = proc.stderr.count("lit_minimind: indexed ")
    return result


def ranks(python: str, data: Path, cache: Path, tokenizer: Path, world: int = 2) -> list[dict[str, Any]]:
    """``world`` probes started at once on one cache (the ranks of a node): each one's result."""
    cmd = lambda: [python, "-m", "benchmarks.bench_data", "--probe", "setup", "--data", str(data), "--cache",
                   str(cache), "--tokenizer", str(tokenizer)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    procs = [subprocess.Popen(cmd(), cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(world)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"rank probe failed ({proc.returncode}): {err[-3000:]}")
        result = json.loads(out.strip().splitlines()[-1])
        result["built"] = err.count("lit_minimind: indexed ")
        results.append(result)
    return results


def minimind_python(explicit: str | None) -> str | None:
    """A Python that can import ``datasets``: ``explicit``, ``$MINIMIND_PYTHON`` or this one; else None."""
    for candidate in (explicit, os.environ.get("MINIMIND_PYTHON"), sys.executable):
        if candidate and subprocess.run([candidate, "-c", "import datasets"], capture_output=True).returncode == 0:
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
        for side in alternating(sides, rep):
            cache = work / f"cache-{side}-{rep}"
            if side == "ours":
                first.append(run_probe(py, "setup", data, cache, tokenizer))
                keep = cache
            else:
                mm_first.append(run_probe(mm_python, "minimind", data, cache, tokenizer))
                if rep < reps - 1:
                    shutil.rmtree(cache, ignore_errors=True)  # MiniMind's Arrow copy: the file's size
        say(f"  rep {rep + 1}: first build {first[-1]['setup_s']:.2f} s"
            + (f", MiniMind's first load {mm_first[-1]['setup_s']:.2f} s" if mm_first else ""))
    cached = [run_probe(py, "setup", data, keep, tokenizer) for _ in range(next_reps)]
    mm_cached = [run_probe(mm_python, "minimind", data, work / f"cache-minimind-{reps - 1}", tokenizer)
                 for _ in range(next_reps)] if mm_python else []
    shutil.rmtree(work / f"cache-minimind-{reps - 1}", ignore_errors=True)
    ddp_cold = ranks(py, data, work / "cache-ddp", tokenizer)
    ddp_cached = ranks(py, data, work / "cache-ddp", tokenizer)
    loader = {w: run_probe(py, "loader", data, keep, tokenizer, workers=w, batches=batches) for w in (0, 2)}
    out: dict[str, Any] = {
        "first_build": stats([r["setup_s"] for r in first]),
        "first_build_cpu": stats([r["cpu_s"] for r in first]),
        "cached_start": stats([r["setup_s"] for r in cached]),
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
        out["minimind"] = {"python": mm_python, "first_load": stats([r["setup_s"] for r in mm_first]),
                           "first_load_cpu": stats([r["cpu_s"] for r in mm_first]),
                           "cached_load": stats([r["setup_s"] for r in mm_cached]),
                           "peak_rss_mib": max(r["peak_rss_mib"] for r in mm_first + mm_cached)}
        out["first_build_vs_minimind"] = stats([o["setup_s"] / m["setup_s"] for o, m in zip(first, mm_first)])
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
    return table(["", "lit-minimind", "MiniMind (`load_dataset('json')`)"], rows)


def plot(p: dict[str, Any], path: Path) -> Path:
    plt = pyplot()
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
    return save_figure(fig, path)


def run(quick: bool = False, results_dir: Path = RESULTS_DIR, reps: int | None = None, threads: int | None = None,
        records: int | None = None, directory: Path | None = None, mm_python: str | None = None) -> dict[str, Any]:
    threads = set_threads(threads)
    records = records or (QUICK_RECORDS if quick else FULL_RECORDS)
    reps = reps or (1 if quick else 3)
    batches = 20 if quick else 200
    mm = minimind_python(mm_python)
    _, tokenizer = default_data()
    say(f"== data set-up: {records:,} records, {reps} repetitions; MiniMind's loader: "
        f"{mm or 'skipped (no Python with `datasets`; --minimind-python)'} ==")
    with tempfile.TemporaryDirectory(prefix="bench-data-", dir=directory) as tmp:
        work = Path(tmp)
        data = work / "pretrain_t2t_mini.jsonl"
        start = time.perf_counter()
        size = generate(data, records)
        say(f"  generated {size / 1e9:.2f} GB in {time.perf_counter() - start:.0f} s")
        measured = measure(data, tokenizer, work, reps, mm, batches, 1 if quick else 3)
    payload = {"benchmark": "data", "quick": quick, "reps": reps, "threads": threads, "environment": environment(),
               "data_bytes": size, **measured,
               "first_build_s": measured["first_build"]["median"], "cached_start_s": measured["cached_start"]["median"],
               "cached_start_target_s": CACHED_TARGET_S,
               "cached_start_target_met": measured["cached_start"]["max"] <= CACHED_TARGET_S}
    payload["table"] = render(payload)
    say(payload["table"])
    write_json(results_dir / "data.json", payload)
    plot(payload, results_dir / "data.png")
    return payload


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, "repetitions of the first start (default 3, quick 1)")
    parser.add_argument("--records", type=int, default=None, help=f"records in the file (default {FULL_RECORDS:,})")
    parser.add_argument("--dir", type=Path, default=None, help="where the file goes (default: the system's temp dir)")
    parser.add_argument("--minimind-python", default=None, help="a Python with `datasets` for MiniMind's loader")
    parser.add_argument("--probe", choices=["setup", "loader", "minimind"], help=argparse_hidden())
    parser.add_argument("--data", help=argparse_hidden())
    parser.add_argument("--cache", help=argparse_hidden())
    parser.add_argument("--tokenizer", help=argparse_hidden())
    parser.add_argument("--workers", type=int, default=0, help=argparse_hidden())
    parser.add_argument("--batches", type=int, default=0, help=argparse_hidden())
    args = parser.parse_args(argv)
    if args.probe:
        print(json.dumps(probe(args.probe, args.data, args.cache, args.tokenizer, args.workers, args.batches)),
              flush=True)
        return 0
    run(args.quick, args.results_dir, args.reps, args.threads, args.records, args.dir, args.minimind_python)
    return 0


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    raise SystemExit(main())
