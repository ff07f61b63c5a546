"""Checkpoint cost: ResumeCallback's save vs MiniMind's save and a bare torch.save: bytes, stall, memory.

The CLI trains ``reps + 2`` micro-batches (4 x 256) with a save after each, sync and async (the default), with
:class:`SaveCost` on its command line: before each save it times MiniMind's save (fp16 export + resume dict) and a bare
``torch.save`` of the dict Lightning assembled for the last save, alternately; after it, ours: the loop's wait
(``ResumeCallback.manager.save_seconds``, the stall; ÷ bare within a repetition) and the time until committed; ``os.sync()``
after each, the first of each kind a warm-up, one more save profiled (cProfile). Bytes: every file a save leaves (a hard
link once); peak extra RSS: ``VmHWM`` minus the RSS before; slowdown at 1000 = stall / (1000 x step). Targets: bytes
<= 1.4x MiniMind's, async stall <= 0.2x bare, slowdown <= 1 %.
"""

from __future__ import annotations

import cProfile
import ctypes
import gc
import os
import pstats
import resource
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import lightning as L

from benchmarks import common as bc
from benchmarks.probes import emit

NAME = "checkpoint"
TARGET_BYTES_RATIO, TARGET_STALL_RATIO, TARGET_SLOWDOWN, SAVE_INTERVAL = 1.4, 0.2, 0.01, 1000
FULL_SIZES, QUICK_SIZES = [(512, 8), (768, 8)], [(64, 2)]
PROFILE_BUCKETS = {  # cProfile entries (a substring of file:function) -> where that time went
    "crc32 (checksumming writer)": ("zlib.crc32",), "fsync (data, manifests, directory)": ("posix.fsync",),
    "os.replace / link over the previous file": ("posix.replace", "posix.link"),
    "write() into the page cache": ("'write' of '_io.BufferedWriter'", "'write' of '_io.TextIOWrapper'"),
    "torch.save serialization": ("write_record", "write_end_of_file", "PyTorchFileWriter", "'dump' of '_pickle",
                                 "serialization.py"),
    "fp16 copy of the weights": ("'half' of",),
    "tensor copies (snapshot)": ("'clone' of", "'copy_' of", "'to' of", "'cpu' of"),
}


def rss_reset() -> int:
    """Freed heap back to the OS, the peak RSS reset to the current RSS (``clear_refs``): that RSS in bytes."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return hwm()


def hwm() -> int:
    return bc.proc_field("status", "VmHWM") * 1024


def thread_usage() -> tuple[float, float, int]:
    r = resource.getrusage(resource.RUSAGE_THREAD)
    return r.ru_utime, r.ru_stime, r.ru_minflt


def buckets(prof: cProfile.Profile, total: float) -> dict[str, float]:
    spent = dict.fromkeys(PROFILE_BUCKETS, 0.0)
    for (filename, _, name), (_, _, tottime, _, _) in pstats.Stats(prof).stats.items():  # type: ignore[attr-defined]
        where = f"{filename}:{name}"
        bucket = next((b for b, needles in PROFILE_BUCKETS.items() if any(n in where for n in needles)), None)
        if bucket:
            spent[bucket] += tottime
    return {**spent, "everything else": max(0.0, total - sum(spent.values())), "total": total}


class SaveCost(L.Callback):
    """Given to the CLI by this benchmark (``--trainer.callbacks+=benchmarks.bench_checkpoint.SaveCost``); at the end
    prints ``@@bench {"event": "savecost", ...}``."""

    def __init__(self, out: str) -> None:
        self.out, self.checkpoint, self.times, self.rss = Path(out), None, defaultdict(list), defaultdict(int)
        self.step, self.before, self.profile, self.batch, self.profiles = [], None, None, 0, {}

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        self.checkpoint = checkpoint

    def on_train_batch_start(self, trainer: L.Trainer, *_: Any) -> None:
        self.ours(trainer, record=self.batch >= 2)  # the save after the first batch warms up
        self.started = time.perf_counter()

    def ours(self, trainer: L.Trainer, record: bool) -> None:
        """Our last save, once written: the loop's wait, the time until committed, the thread's CPU time around it."""
        if self.before is None:
            return
        trainer.strategy.checkpoint_io.wait()
        rss, usage = hwm() - self.before[0], thread_usage()
        os.sync()
        if record:
            self.times["ours"].append(trainer.checkpoint_callback.manager.save_seconds[0])
            self.times["ours_written"].append(trainer.checkpoint_callback.manager.save_seconds[1])
            for key, a, b in zip(("ours_user", "ours_sys", "ours_minflt"), self.before[1], usage):
                self.times[key].append(b - a)
            self.rss["ours"] = max(self.rss["ours"], rss)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *_: Any) -> None:
        import torch

        self.step.append(time.perf_counter() - self.started)
        self.batch += 1
        optimizer, stem = trainer.optimizers[0], trainer.checkpoint_callback.stem(pl_module)

        def minimind() -> None:
            weights = {k: v.detach().half().cpu() for k, v in pl_module.model.state_dict().items()}
            torch.save(weights, self.out / "minimind" / f"{stem}.pth")
            torch.save({"model": weights, "optimizer": optimizer.state_dict(), "epoch": trainer.current_epoch,
                        "step": self.batch, "world_size": 1, "wandb_id": None, "scaler": {}},
                       self.out / "minimind" / f"{stem}_resume.pth")

        saves = {"minimind": minimind, "bare": lambda: torch.save(self.checkpoint, self.out / "bare" / f"{stem}.ckpt")}
        if self.batch >= 2:  # after ResumeCallback's first save: there is a checkpoint dict to write bare
            for name in bc.alternating(list(saves), self.batch):
                before, t = rss_reset(), time.perf_counter()
                saves[name]()
                seconds, rss = time.perf_counter() - t, hwm() - before
                os.sync()
                if self.batch >= 3:  # the first of each: a warm-up
                    self.times[name].append(seconds)
                    self.rss[name] = max(self.rss[name], rss)
            if self.batch == trainer.max_steps and not trainer.checkpoint_callback.manager.async_save:
                prof, t = cProfile.Profile(), time.perf_counter()
                prof.runcall(minimind)
                self.profiles["minimind"] = buckets(prof, time.perf_counter() - t)
        self.before = (rss_reset(), thread_usage())
        if self.batch == trainer.max_steps:  # the last save: profiled
            self.profile = cProfile.Profile()
            self.profile.enable()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.profile.disable()
        self.ours(trainer, record=False)
        self.profiles["ours"] = buckets(self.profile, trainer.checkpoint_callback.manager.save_seconds[0])
        emit("savecost", times=self.times, rss=self.rss, params=int(pl_module.model.num_parameters()),
             snapshot_bytes=trainer.strategy.checkpoint_io.snapshot_bytes, step_s=statistics.median(self.step[1:]),
             profile=self.profiles)


def written_files(*directories: Path) -> dict[str, Any]:
    """Bytes of the files in ``directories``, each inode counted once (a hard link names the file it links to)."""
    seen: dict[tuple[int, int], str] = {}
    out: dict[str, Any] = {"data": 0, "manifests": 0, "files": {}, "hard_links": []}
    for directory in directories:
        for p in sorted(q for q in directory.rglob("*") if q.is_file() and not q.name.endswith(".tmp")):
            st, name = p.stat(), f"{directory.name}/{p.relative_to(directory)}"
            if (st.st_dev, st.st_ino) in seen:
                out["hard_links"].append([name, seen[(st.st_dev, st.st_ino)]])
                continue
            seen[(st.st_dev, st.st_ino)] = name
            out["files"][name] = st.st_size
            out["manifests" if p.name.endswith(".manifest.json") else "data"] += st.st_size
    return {**out, "total": out["data"] + out["manifests"]}


def summarize_mode(raw: dict[str, Any]) -> dict[str, Any]:
    t = raw["times"]
    return {"save_s": bc.stats(t["ours"]), "save_and_write_s": bc.stats(t["ours_written"]),
            "bare_torch_save_s": bc.stats(t["bare"]), "minimind_save_s": bc.stats(t["minimind"]),
            "stall_ratio": bc.ratios(t["ours"], t["bare"]),
            "stall_ratio_vs_minimind": bc.ratios(t["ours"], t["minimind"]),
            # CPU time of the training thread around the save (system time: mostly page faults of fresh memory)
            "stall_cpu_user_s": bc.stats(t["ours_user"]), "stall_cpu_sys_s": bc.stats(t["ours_sys"]),
            "stall_minor_faults": bc.stats(t["ours_minflt"]), "bytes_ours": raw["bytes_ours"]["total"],
            "peak_extra_rss_bytes": raw["rss"]["ours"],
            "snapshot_bytes": raw["snapshot_bytes"]}  # held between saves (async), reused by the next one


def measure(hidden: int, layers: int, reps: int, quick: bool, data: Path, tok: Path) -> dict[str, Any]:
    """Both save modes of one model, each in its own CLI run."""
    name, (batch, seq), raw = f"{hidden}x{layers}", (2, 32) if quick else (4, 256), {}
    flags = {"trainer.max_steps": reps + 2, "resume.save_interval": 1, "resume.keep_last": 1}
    with bc.workdir("ckpt") as tmp:
        for mode in ("sync", "async"):
            bc.say(f"  [{name}] {mode} saves: {reps + 2} batches, a save after each ...")
            work = tmp / mode
            for sub in ("minimind", "bare"):
                (work / sub).mkdir(parents=True)
            cmd = bc.fit_cmd(work, data, tok, (hidden, layers, seq, batch),
                             {**flags, "resume.async_save": str(mode == "async").lower()},
                             "--trainer.callbacks+=benchmarks.bench_checkpoint.SaveCost",
                             f"--trainer.callbacks.out={work}")
            if (got := bc.event(bc.launch(cmd, work), "savecost")) is None:
                raise RuntimeError(f"the save probe reported nothing ({mode}, {name})")
            raw[mode] = {**got, "bytes_minimind": written_files(work / "minimind"),
                         "bytes_ours": written_files(work / "checkpoints", work / "out"),
                         "bytes_bare": written_files(work / "bare")}
    ours, mm, step = raw["async"]["bytes_ours"], raw["async"]["bytes_minimind"], raw["async"]["step_s"]
    ckpt = sum(v for k, v in ours["files"].items() if k.endswith(".ckpt"))
    modes = {mode: summarize_mode(r) for mode, r in raw.items()}
    stall = modes["async"]["save_s"]["median"]  # the default save's
    return {
        "model": name, "hidden_size": hidden, "num_hidden_layers": layers, "params": raw["async"]["params"],
        "modes": modes, "bytes_ours": ours["total"], "bytes_minimind": mm["total"],
        "bytes_ratio_vs_minimind": ours["total"] / mm["total"],
        "bytes": {"ours_files": ours["files"], "ours_hard_links": ours["hard_links"], "ours_data": ours["data"],
                  "ours_manifests": ours["manifests"], "ours_ckpt": ckpt, "ours_export": ours["data"] - ckpt,
                  "resume_is_hard_link_to_ckpt": any(a.endswith("_resume.pth") and b.endswith(".ckpt")
                                                     for a, b in ours["hard_links"]),
                  "minimind_files": mm["files"], "bare_ckpt": raw["async"]["bytes_bare"]["total"]},
        "step_s": step, "step_batch": [batch, seq], "slowdown_at_save_interval_1000": stall / (SAVE_INTERVAL * step),
        "break_even_step_s_for_1pct": stall / (SAVE_INTERVAL * TARGET_SLOWDOWN),
        "peak_extra_rss_bytes": {"minimind": raw["sync"]["rss"]["minimind"], "bare": raw["sync"]["rss"]["bare"],
                                 **{f"ours_{m}": r["rss"]["ours"] for m, r in raw.items()}},
        "profile_s": {"minimind": raw["sync"]["profile"]["minimind"],
                      **{f"ours_{m}": r["profile"]["ours"] for m, r in raw.items()}}}


def render(results: list[dict[str, Any]]) -> tuple[str, str, str]:
    mib = lambda n: f"{n / 2**20:.0f}"
    rows, rows2 = [], []
    for r in results:
        m, rss, b = r["modes"], r["peak_extra_rss_bytes"], r["bytes"]
        rows.append([r["model"], f"{r['params'] / 1e6:.1f}M", f"{mib(r['bytes_ours'])} / {mib(r['bytes_minimind'])}",
                     f"**{r['bytes_ratio_vs_minimind']:.2f}** (≤ {TARGET_BYTES_RATIO}: "
                     f"{bc.yes(r['bytes_ratio_vs_minimind'] <= TARGET_BYTES_RATIO)})",
                     bc.spread(m["async"]["minimind_save_s"]), bc.spread(m["async"]["bare_torch_save_s"]),
                     f"{bc.spread(m['sync']['save_s'])}, ×{m['sync']['stall_ratio']['median']:.2f}",
                     f"{bc.spread(m['async']['save_s'])}, **×{m['async']['stall_ratio']['median']:.2f}**",
                     " / ".join(mib(rss[k]) for k in ("minimind", "ours_sync", "ours_async"))])
        cpu = " / ".join(f"{m[k]['stall_cpu_user_s']['median']:.2f} + {m[k]['stall_cpu_sys_s']['median']:.2f}"
                         for k in ("sync", "async"))
        slowdown = r["slowdown_at_save_interval_1000"]
        rows2.append([r["model"], f"{mib(b['ours_ckpt'])} + {mib(b['ours_export'])} (+{b['ours_manifests']} B "
                      "manifests)", mib(b["bare_ckpt"]), mib(m["async"]["snapshot_bytes"]),
                      f"×{m['sync']['stall_ratio_vs_minimind']['median']:.2f}",
                      f"{m['async']['save_and_write_s']['median']:.3f}", cpu,
                      f"{r['step_s']:.3f} ({r['step_batch'][0]}x{r['step_batch'][1]})",
                      f"**{100 * slowdown:.3f}%** ({bc.yes(slowdown <= TARGET_SLOWDOWN)})",
                      f"{r['break_even_step_s_for_1pct']:.3f}"])
    main = bc.table(["model", "params", "MiB per save ours / MiniMind", "bytes ours ÷ MiniMind",
                     "MiniMind save s med (min–max)", "bare torch.save s", "ours sync: stall s, ÷ bare",
                     "ours async: stall s, ÷ bare", "peak extra RSS MiB MiniMind / ours sync / async"], rows)
    detail = bc.table(["model", "ours MiB: .ckpt + export", "bare .ckpt MiB", "async snapshot held between saves MiB",
                       "ours sync ÷ MiniMind save", "async save + write s", "stall CPU user + sys s, sync / async",
                       "step s (batch)", "slowdown @1000, async (≤ 1%)", "1% break-even step s"], rows2)
    sides = [(r, side) for r in results for side in r["profile_s"]]
    profile = bc.table(["one save (cProfile, training thread), s"] + [f"{r['model']} {side}" for r, side in sides],
                       [[bk] + [f"{r['profile_s'][side][bk]:.3f}" for r, side in sides]
                        for bk in [*PROFILE_BUCKETS, "everything else", "total"]])
    return main, detail, profile


def plot(p: dict[str, Any], path: Path) -> Path:
    keys = [("minimind_save_s", "sync", "MiniMind save (2 files)"), ("bare_torch_save_s", "sync", "bare torch.save"),
            ("save_s", "sync", "ours, sync"), ("save_s", "async", "ours, async (stall)"),
            ("save_and_write_s", "async", "ours, async save + background write")]
    seconds = [(f"{r['model']}: {label}", r["modes"][mode][key], f"C{i}") for r in p["results"]
               for i, (key, mode, label) in enumerate(keys)]
    size = [(f"{r['model']}: {who}", r[key] / 2**20, "tab:gray" if who == "MiniMind" else "tab:orange")
            for r in p["results"] for who, key in (("MiniMind", "bytes_minimind"), ("ours", "bytes_ours"))]
    return bc.chart(path, ("checkpoint save: training-loop stall", "seconds per save (median, min–max)", seconds),
                    ("bytes per save", "MiB written per save", size))


def run(quick: bool = False, reps: int | None = None) -> dict[str, Any]:
    reps = reps or (2 if quick else 5)
    data, tok = bc.default_data()
    results = [measure(h, n, reps, quick, data, tok) for h, n in (QUICK_SIZES if quick else FULL_SIZES)]
    main, detail, profile = render(results)
    rates = bc.byte_rates(8 if quick else 64)
    return {"reps": reps, "disk_dir": bc.rel(bc.cache_dir()), "results": results, "table": main,
            "detail_table": detail, "rates_gb_per_s": rates, "rates_verdict": "Per-byte work on this machine: "
            + ", ".join(f"{k} {v:.2f} GB/s" for k, v in rates.items()) + ".", "profile_table": profile}


if __name__ == "__main__":
    from benchmarks.run_all import main
    raise SystemExit(main(alone=NAME))
