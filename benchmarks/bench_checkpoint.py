"""Checkpoint cost: one save of MiniMind's two files vs a bare ``torch.save`` of the same tensors.

For each model size a MiniMind model and its AdamW state (one optimizer step taken, so the
moments exist) are saved, alternately, by

* ``bare torch.save`` - what MiniMind's ``lm_checkpoint`` does: fp16 CPU copy of the weights,
  ``torch.save`` of the weights file and of the resume dict (fp16 weights + optimizer), no
  fsync, no hash: the baseline;
* ``save_resume_checkpoint`` - ours: the same two files, each written to a tmp file through a
  CRC-32-checksumming writer, fsynced, renamed into place, plus a fsynced manifest;

and, to tell where the difference goes, by the same ``torch.save`` through a Python file
object, through the hashing writer, and with an fsync. Every save starts with no dirty pages
(``os.sync()`` after each one, outside the timing), on the disk that holds the cache dir.

What the training loop actually pays at each ``save_interval`` is :meth:`ResumeCallback.save`:
a Lightning checkpoint plus both MiniMind files (with fp32 weights, RNG and loop state). It is
timed on a real ``Trainer`` that has taken one step; the slowdown at ``save_interval`` 1000 is
``save / (1000 x step)``, with the step time of one micro-batch (batch 4 x seq 256) measured
here, and the step time under which that slowdown would exceed 1% is given for other hardware.

Peak extra RSS of one save: ``VmHWM - VmRSS`` around it (the high-water mark is reset through
``/proc/self/clear_refs``; where that is not allowed, a thread samples ``/proc/self/statm``).

``python -m benchmarks.bench_checkpoint [--quick] [--reps N]``
"""

from __future__ import annotations

import cProfile
import ctypes
import gc
import pstats
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import (
    RESULTS_DIR,
    bench_parser,
    alternating,
    cache_dir,
    default_data,
    environment,
    pyplot,
    rel,
    quiet,
    save_figure,
    say,
    set_threads,
    stats,
    table,
    write_json,
)

TARGET_RATIO = 1.3
TARGET_SLOWDOWN = 0.01
SAVE_INTERVAL = 1000
FULL_SIZES = [(512, 8), (768, 8)]
QUICK_SIZES = [(64, 2)]
STEP_BATCH, STEP_SEQ = 4, 256  # micro-batch used for the step time
QUICK_STEP_BATCH, QUICK_STEP_SEQ = 2, 32

VARIANTS = {
    "bare": "bare torch.save (MiniMind)",
    "fileobj": "torch.save via file object",
    "hashed": "+ crc32 writer",
    "fsync": "bare + fsync",
    "ours": "save_resume_checkpoint (ours)",
}


# --------------------------------------------------------------------------- memory


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _trim() -> None:
    """Give freed heap back to the OS, so the next save's growth shows in RSS."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def peak_extra_rss(fn: Callable[[], Any]) -> tuple[int, str]:
    """``(peak RSS during fn - RSS before, method)``."""
    _trim()
    before = _rss_bytes()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        fn()
        return max(0, _status_kb("VmHWM") - before), "VmHWM"
    except OSError:
        pass
    peak, done = [before], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss_bytes())
            time.sleep(0.0005)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        fn()
    finally:
        done.set()
        thread.join()
    return max(0, peak[0] - before), "sampled /proc/self/statm"


# --------------------------------------------------------------------------- subjects


def trained_model(hidden: int, layers: int):
    """A MiniMind model and AdamW after one step (so the optimizer holds its moments)."""
    import torch

    from lit_minimind.model import MiniMindConfig, MiniMindForCausalLM

    torch.manual_seed(0)
    model = MiniMindForCausalLM(MiniMindConfig(hidden_size=hidden, num_hidden_layers=layers))
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-4, weight_decay=0.01)
    x = torch.randint(3, 6400, (2, 16))
    model(x, labels=x).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def savers(model: Any, optimizer: Any, hidden: int, directory: Path) -> dict[str, Callable[[], Any]]:
    import torch

    from lit_minimind.checkpoint import _HashingWriter, checkpoint_paths, save_resume_checkpoint

    weights_path, resume_path = checkpoint_paths(directory, "pretrain", hidden)
    directory.mkdir(parents=True, exist_ok=True)

    def minimind_objects() -> tuple[dict, dict]:
        weights = {k: v.detach().half().cpu() for k, v in model.state_dict().items()}
        resume = {"model": weights, "optimizer": optimizer.state_dict(), "epoch": 0, "step": 1000,
                  "world_size": 1, "wandb_id": None}
        return weights, resume

    def bare() -> None:
        weights, resume = minimind_objects()
        torch.save(weights, weights_path)
        torch.save(resume, resume_path)

    def through(wrap: Callable[[Any], Any], fsync: bool) -> Callable[[], None]:
        def save() -> None:
            for obj, path in zip(minimind_objects(), (weights_path, resume_path)):
                with open(path, "wb") as f:
                    torch.save(obj, wrap(f))
                    if fsync:
                        f.flush()
                        os.fsync(f.fileno())
        return save

    def ours() -> None:
        save_resume_checkpoint(model, optimizer, save_dir=directory, weight="pretrain", hidden_size=hidden,
                               use_moe=False, epoch=0, step=1000)

    return {
        "bare": bare,
        "fileobj": through(lambda f: f, fsync=False),
        "hashed": through(_HashingWriter, fsync=False),
        "fsync": through(lambda f: f, fsync=True),
        "ours": ours,
    }


def lightning_trainer(hidden: int, layers: int, workdir: Path, data: Path, tok: Path):
    """A real Trainer with ResumeCallback after one training step (nothing saved yet)."""
    import lightning as L

    from callbacks import ResumeCallback
    from lit_minimind.datamodule import MiniMindDataModule
    from lit_minimind.module import LitMiniMind

    L.seed_everything(0, verbose=False)
    module = LitMiniMind(hidden_size=hidden, num_hidden_layers=layers)
    datamodule = MiniMindDataModule(data_path=str(data), tokenizer_path=str(tok), max_seq_len=16, batch_size=2)
    callback = ResumeCallback(save_interval=10**9, out_dir=str(workdir / "out"), ckpt_dir=str(workdir / "checkpoints"))
    with quiet():
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, callbacks=[callback], logger=False,
                            default_root_dir=str(workdir), use_distributed_sampler=False,
                            enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(module, datamodule=datamodule)
    return trainer, module, callback


def step_time(hidden: int, layers: int, batch: int, seq: int, steps: int = 2) -> float:
    """Seconds of one training micro-batch (forward, backward, AdamW step) of this model."""
    import torch

    model, optimizer = trained_model(hidden, layers)
    x = torch.randint(3, 6400, (batch, seq))
    times = []
    for _ in range(steps + 1):
        t = time.perf_counter()
        model(x, labels=x).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t)
    return min(times[1:])


# cProfile entries (substring of the function name, tottime) -> where that time went
PROFILE_BUCKETS = {
    "crc32 (checksumming writer)": ("zlib.crc32",),
    "fsync (data, manifests, directory)": ("posix.fsync",),
    "os.replace over the previous file": ("posix.replace",),
    "write() into the page cache": ("'write' of '_io.BufferedWriter'", "'write' of '_io.TextIOWrapper'"),
    "torch.save serialization": ("write_record", "write_end_of_file", "PyTorchFileWriter", "'dump' of '_pickle",
                                 "serialization.py"),
    "fp16 copy of the weights": ("'half' of",),
}


def profile_save(fn: Callable[[], Any]) -> dict[str, float]:
    """Seconds of one save by what they were spent on (cProfile tottime; few calls, little distortion)."""
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    fn()
    prof.disable()
    total = time.perf_counter() - start
    os.sync()
    spent = {bucket: 0.0 for bucket in PROFILE_BUCKETS}
    for (filename, _, name), (_, _, tottime, _, _) in pstats.Stats(prof).stats.items():  # type: ignore[attr-defined]
        where = f"{filename}:{name}"
        for bucket, needles in PROFILE_BUCKETS.items():
            if any(needle in where for needle in needles):
                spent[bucket] += tottime
                break
    spent["everything else"] = max(0.0, total - sum(spent.values()))
    spent["total"] = total
    return spent


def digest_rates(mib: int = 64) -> dict[str, float]:
    """GB/s of the per-byte work a save may add, on this machine (best of 3 over ``mib`` MiB)."""
    import hashlib
    import zlib

    buf = os.urandom(mib << 20)
    work = {
        "sha256": lambda: hashlib.sha256(buf).digest(),
        "crc32 (zlib)": lambda: zlib.crc32(buf),
        "memory copy": lambda: bytearray(buf),
    }
    rates = {}
    for name, fn in work.items():
        best = min(timed_nosync(fn) for _ in range(3))
        rates[name] = len(buf) / best / 1e9
    return rates


def timed_nosync(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    elapsed = time.perf_counter() - t
    os.sync()  # the next save starts without this one's dirty pages (outside the timing)
    return elapsed


def dir_bytes(directory: Path, pattern: str) -> int:
    return sum(p.stat().st_size for p in directory.rglob(pattern) if p.is_file())


# --------------------------------------------------------------------------- benchmark


def measure(hidden: int, layers: int, reps: int, quick: bool, data: Path, tok: Path) -> dict[str, Any]:
    name = f"{hidden}x{layers}"
    root = Path(tempfile.mkdtemp(prefix="bench-ckpt-", dir=cache_dir()))
    try:
        model, optimizer = trained_model(hidden, layers)
        params = model.num_parameters()
        fns = savers(model, optimizer, hidden, root / "minimind")
        say(f"  [{name}] {params / 1e6:.1f}M params: warm-up saves ...")
        for fn in fns.values():
            timed(fn)
        times: dict[str, list[float]] = {k: [] for k in fns}
        for rep in range(reps):
            for key in alternating(list(fns), rep):
                times[key].append(timed(fns[key]))
        ratios = [o / b for o, b in zip(times["ours"], times["bare"])]
        sizes = {"weights_bytes": dir_bytes(root / "minimind", "pretrain_*[0-9].pth"),
                 "resume_bytes": dir_bytes(root / "minimind", "*_resume.pth")}
        rss = {key: peak_extra_rss(fns[key]) for key in ("bare", "ours")}
        profiles = {key: profile_save(fns[key]) for key in ("bare", "ours")}
        del fns, model, optimizer
        _trim()

        # the whole save the training loop does (Lightning .ckpt + both MiniMind files)
        trainer, module, callback = lightning_trainer(hidden, layers, root / "lightning", data, tok)
        lightning_ckpt = root / "lightning" / "checkpoints" / "bare_lightning.ckpt"

        def callback_save() -> None:
            callback.save(trainer, module, 0, 1)

        def lightning_only() -> None:
            trainer.save_checkpoint(root / "lightning" / "checkpoints" / "only_lightning.ckpt")

        def lightning_bare() -> None:
            import torch

            torch.save(trainer._checkpoint_connector.dump_checkpoint(weights_only=False), lightning_ckpt)

        lfns = {"callback": callback_save, "lightning": lightning_only, "lightning_bare": lightning_bare}
        with quiet():
            for fn in lfns.values():
                timed(fn)
            ltimes: dict[str, list[float]] = {k: [] for k in lfns}
            for rep in range(reps):
                for key in alternating(list(lfns), rep):
                    ltimes[key].append(timed(lfns[key]))
            rss["callback"] = peak_extra_rss(callback_save)
        callback_bytes = dir_bytes(root / "lightning", "pretrain_*")  # .ckpt + both .pth (+ manifests)
        del trainer, module, callback, lfns
        _trim()
    finally:
        shutil.rmtree(root, ignore_errors=True)

    batch, seq = (QUICK_STEP_BATCH, QUICK_STEP_SEQ) if quick else (STEP_BATCH, STEP_SEQ)
    step = step_time(hidden, layers, batch, seq)
    s = {k: stats(v) for k, v in times.items()}
    ls = {k: stats(v) for k, v in ltimes.items()}
    ratio = stats(ratios)
    callback_s = ls["callback"]["median"]
    slowdown = callback_s / (SAVE_INTERVAL * step)
    result = {
        "model": name, "hidden_size": hidden, "num_hidden_layers": layers, "params": params,
        "save_s": s, "ratio_ours_vs_bare": ratio, "target_ratio": TARGET_RATIO,
        "target_ratio_met": ratio["median"] <= TARGET_RATIO,
        "lightning_save_s": ls, "lightning_ratio_vs_bare": ls["lightning"]["median"] / ls["lightning_bare"]["median"],
        "bytes": {**sizes, "callback_save_bytes": callback_bytes},
        "step_s": step, "step_batch": [batch, seq],
        "slowdown_at_save_interval_1000": slowdown, "target_slowdown": TARGET_SLOWDOWN,
        "target_slowdown_met": slowdown <= TARGET_SLOWDOWN,
        "break_even_step_s_for_1pct": callback_s / (SAVE_INTERVAL * TARGET_SLOWDOWN),
        "peak_extra_rss_bytes": {k: v[0] for k, v in rss.items()}, "rss_method": rss["ours"][1],
        "profile_s": profiles,
    }
    say(f"  [{name}] bare {s['bare']['median']:.3f}s, ours {s['ours']['median']:.3f}s "
        f"(x{ratio['median']:.2f}), callback save {callback_s:.3f}s, step {step:.3f}s")
    return result


def render(results: list[dict[str, Any]]) -> tuple[str, str]:
    mb = 1 / 2**20
    rows = []
    for r in results:
        s, q = r["save_s"], r["ratio_ours_vs_bare"]
        rss = r["peak_extra_rss_bytes"]
        rows.append([
            r["model"], f"{r['params'] / 1e6:.1f}M",
            f"{(r['bytes']['weights_bytes'] + r['bytes']['resume_bytes']) * mb:.0f}",
            f"{s['bare']['median']:.3f} ({s['bare']['min']:.3f}–{s['bare']['max']:.3f})",
            f"{s['ours']['median']:.3f} ({s['ours']['min']:.3f}–{s['ours']['max']:.3f})",
            f"**{q['median']:.2f}** ({q['min']:.2f}–{q['max']:.2f})",
            f"≤ {r['target_ratio']}: {'yes' if r['target_ratio_met'] else 'NO'}",
            f"{rss['bare'] * mb:.0f} / {rss['ours'] * mb:.0f}",
        ])
    main = table(["model", "params", "2 files MiB", "bare torch.save s med (min–max)", "ours s med (min–max)",
                  "ours / bare med (min–max)", "target", "peak extra RSS MiB bare / ours"], rows)
    rows2 = []
    for r in results:
        ls, rss = r["lightning_save_s"], r["peak_extra_rss_bytes"]
        rows2.append([
            r["model"],
            " / ".join(f"{r['save_s'][k]['median']:.3f}" for k in ("bare", "fileobj", "hashed", "fsync", "ours")),
            f"{ls['lightning_bare']['median']:.3f} / {ls['lightning']['median']:.3f}",
            f"{ls['callback']['median']:.3f} ({ls['callback']['min']:.3f}–{ls['callback']['max']:.3f}), "
            f"{r['bytes']['callback_save_bytes'] * mb:.0f} MiB, +{rss['callback'] * mb:.0f} MiB RSS",
            f"{r['step_s']:.3f} ({r['step_batch'][0]}x{r['step_batch'][1]})",
            f"**{100 * r['slowdown_at_save_interval_1000']:.3f}%** ({'yes' if r['target_slowdown_met'] else 'NO'})",
            f"{r['break_even_step_s_for_1pct']:.3f}",
        ])
    detail = table(["model", "bare / file obj / +crc32 / +fsync / ours (s, median)",
                    "Lightning .ckpt bare / ours (s)", "ResumeCallback.save (all files)", "step s (batch)",
                    "slowdown @1000 (≤ 1%)", "1% break-even step s"], rows2)
    return main, detail


def render_profile(results: list[dict[str, Any]]) -> str:
    buckets = [*PROFILE_BUCKETS, "everything else", "total"]
    headers = ["one save (cProfile), s"] + [f"{r['model']} {side}" for r in results for side in ("bare", "ours")]
    rows = [[b] + [f"{r['profile_s'][side][b]:.3f}" for r in results for side in ("bare", "ours")] for b in buckets]
    return table(headers, rows)


def plot(results: list[dict[str, Any]], path: Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 3.2))
    keys = list(VARIANTS) + ["lightning_bare", "lightning", "callback"]
    labels = list(VARIANTS.values()) + ["Lightning .ckpt, bare torch.save", "Lightning .ckpt (ours)",
                                        "ResumeCallback.save (all)"]
    width = 0.8 / len(results)
    for i, r in enumerate(results):
        vals = [(r["save_s"].get(k) or r["lightning_save_s"].get(k)) for k in keys]
        med = [v["median"] for v in vals]
        err = [[v["median"] - v["min"] for v in vals], [v["max"] - v["median"] for v in vals]]
        ax.barh([j + i * width for j in range(len(keys))], med, width, xerr=err, capsize=2,
                label=f"{r['model']} ({r['params'] / 1e6:.0f}M)")
    ax.set_yticks([j + width * (len(results) - 1) / 2 for j in range(len(keys))], labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds per save (median, min–max)")
    ax.set_title("checkpoint save cost")
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def run(quick: bool = False, results_dir: Path = RESULTS_DIR, reps: int | None = None,
        threads: int | None = None) -> dict[str, Any]:
    threads = set_threads(threads)
    reps = reps or (2 if quick else 5)
    sizes = QUICK_SIZES if quick else FULL_SIZES
    data, tok = default_data()
    say(f"== checkpoint cost ({reps} alternating repetitions after warm-up, {threads} torch thread(s)) ==")
    results = [measure(h, n, reps, quick, data, tok) for h, n in sizes]
    rates = digest_rates(8 if quick else 64)
    main_table, detail_table = render(results)
    profile_table = render_profile(results)
    text = main_table + "\n\n" + detail_table + "\n\n" + profile_table
    say(text)
    say("per-byte work on this machine: " + ", ".join(f"{k} {v:.2f} GB/s" for k, v in rates.items()))
    payload = {"benchmark": "checkpoint", "quick": quick, "reps": reps, "threads": threads,
               "environment": environment(), "disk_dir": rel(cache_dir()), "variants": VARIANTS,
               "results": results, "table": main_table, "detail_table": detail_table, "profile_table": profile_table,
               "rates_gb_per_s": rates}
    write_json(results_dir / "checkpoint.json", payload)
    plot(results, results_dir / "checkpoint.png")
    return payload


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, "alternating repetitions (default 5, quick 2)")
    args = parser.parse_args(argv)
    run(args.quick, args.results_dir, args.reps, args.threads)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
