"""Checkpoint cost: one real ``ResumeCallback.save`` vs MiniMind's save and a bare ``torch.save``.

For each model size a real ``lightning.Trainer`` (CPU, ``plugins=[SafeCheckpointIO()]``, the
``ResumeCallback``, ``LitMiniMind``, ``MiniMindDataModule``) trains one batch; at the end of that
batch, where the callback itself saves (``on_train_batch_end``, after the optimizer step, so AdamW
holds its moments), a probe callback times, alternately,

* ``minimind`` - what MiniMind writes per save: the fp16 export (``{k: v.half().cpu()}``) and the
  resume dict (``model`` fp16, ``optimizer`` state, epoch/step/...), each a plain ``torch.save``;
* ``bare`` - a bare ``torch.save`` of the same Lightning checkpoint dict ours writes (the dict
  Lightning assembled for our last save, with our hooks' keys, captured by the probe callback's
  ``on_save_checkpoint``);
* ``ours`` - :meth:`ResumeCallback.save`: Lightning's checkpoint dict with MiniMind's keys, written
  atomically with a manifest by ``SafeCheckpointIO``, the hard link ``{stem}_resume.pth`` and the
  fp16 export. The time inside ``save`` is what the training loop is blocked for (``save_s``).

When ``ResumeCallback`` takes ``async_save``, both modes run, each on its own Trainer: ``sync``
(``async_save=False``) and ``async``, where ``save`` returns after a snapshot and a background
thread writes; the write is waited for (outside the stall timing) before the next repetition and
before the bytes are counted. ``async_stall_ratio`` = ``save_s`` / ``bare_torch_save_s`` of the
mode the callback uses by default (async when it exists), within each repetition (target <= 0.2).

Bytes: everything one save leaves on disk, from ``st_size``, a hard-linked file counted once
(``st_ino``): ours = the ``.ckpt`` + the export (+ three small manifests); MiniMind = export + resume
dict. Every save starts with no dirty pages (``os.sync()`` after each one, outside the timing), on
the disk that holds the cache dir.

The slowdown at ``save_interval`` 1000 is ``save_s / (1000 x step)``, with the step time of one
micro-batch (batch 4 x seq 256) measured here; the step time under which that slowdown would exceed
1% is given for other hardware.

Peak extra RSS of one save (for ``ours`` async: until its write is done): ``VmHWM - VmRSS`` around
it (the high-water mark is reset through ``/proc/self/clear_refs``; where that is not allowed, a
thread samples ``/proc/self/statm``). An asynchronous save keeps its snapshot buffers from one save
to the next (reused, so the stall pays no page faults): that resident copy is reported separately
(``snapshot_bytes``, ``SafeCheckpointIO.snapshot_bytes``).

``python -m benchmarks.bench_checkpoint [--quick] [--reps N]``
"""

from __future__ import annotations

import cProfile
import ctypes
import gc
import inspect
import os
import pstats
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import (
    RESULTS_DIR,
    alternating,
    bench_parser,
    cache_dir,
    default_data,
    environment,
    pyplot,
    quiet,
    rel,
    save_figure,
    say,
    set_threads,
    stats,
    table,
    write_json,
)

TARGET_BYTES_RATIO = 1.4
TARGET_STALL_RATIO = 0.2  # async stall / bare torch.save (issue #11)
TARGET_SLOWDOWN = 0.01
SAVE_INTERVAL = 1000
FULL_SIZES = [(512, 8), (768, 8)]
QUICK_SIZES = [(64, 2)]
STEP_BATCH, STEP_SEQ = 4, 256  # micro-batch used for the step time
QUICK_STEP_BATCH, QUICK_STEP_SEQ = 2, 32
WAIT_METHODS = ("_wait_for_writes", "wait")  # ResumeCallback's, where the checkpoint IO has no wait()

VARIANTS = {
    "minimind": "MiniMind: export + resume dict (torch.save)",
    "bare": "bare torch.save of our checkpoint dict",
    "ours": "ResumeCallback.save (ours)",
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


# --------------------------------------------------------------------------- the callback's save modes


def async_supported() -> bool:
    """Whether ``ResumeCallback`` takes ``async_save`` (then both modes are measured)."""
    from lit_minimind.callbacks import ResumeCallback

    return "async_save" in inspect.signature(ResumeCallback.__init__).parameters


def make_callback(mode: str, workdir: Path):
    from lit_minimind.callbacks import ResumeCallback

    kwargs: dict[str, Any] = {"async_save": mode == "async"} if async_supported() else {}
    return ResumeCallback(save_interval=10**9, out_dir=str(workdir / "out"), ckpt_dir=str(workdir / "checkpoints"),
                          **kwargs)


def wait_for_writes(callback: Any, trainer: Any, module: Any, mode: str) -> None:
    """Block until the save's background write (if any) is on disk; raise if it failed."""
    io = trainer.strategy.checkpoint_io
    wait = getattr(io, "wait", None)  # SafeCheckpointIO: returns once everything submitted is written
    if wait is None:
        wait = next((getattr(callback, n) for n in WAIT_METHODS if callable(getattr(callback, n, None))), None)
    if wait is None:
        if mode == "async":
            raise RuntimeError(f"neither the checkpoint IO nor ResumeCallback has a wait method ({WAIT_METHODS}): "
                               "cannot wait for an asynchronous write")
        return
    required = [p for p in inspect.signature(wait).parameters.values()
                if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    wait(*(trainer, module)[:len(required)])
    take_error = getattr(io, "take_error", None)
    error = take_error() if take_error is not None else None
    if error is not None:
        raise RuntimeError(f"a checkpoint write failed during the benchmark: {error}")


# --------------------------------------------------------------------------- files


def written_files(*directories: Path) -> dict[str, Any]:
    """Bytes of the files in ``directories`` (tmp files excluded), each inode counted once."""
    seen: dict[tuple[int, int], str] = {}
    data = manifests = 0
    files, links = {}, []
    for directory in directories:
        for p in sorted(directory.rglob("*")):
            if not p.is_file() or p.name.endswith(".tmp"):
                continue
            st = p.stat()
            key = (st.st_dev, st.st_ino)
            name = f"{directory.name}/{p.relative_to(directory)}"
            if key in seen:
                links.append([name, seen[key]])
                continue
            seen[key] = name
            files[name] = st.st_size
            if p.name.endswith(".manifest.json"):
                manifests += st.st_size
            else:
                data += st.st_size
    return {"total": data + manifests, "data": data, "manifests": manifests, "files": files, "hard_links": links}


def _thread_rusage() -> tuple[float, float, int]:
    """(user s, system s, minor page faults) of the calling thread (of the process where unsupported)."""
    import resource

    who = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)
    r = resource.getrusage(who)
    return r.ru_utime, r.ru_stime, r.ru_minflt


def timed(fn: Callable[[], Any]) -> Any:
    """``fn()`` (which returns its own timings), then ``os.sync()`` outside them: the next save
    starts without this one's dirty pages."""
    out = fn()
    os.sync()
    return out


# --------------------------------------------------------------------------- profile


# cProfile entries (substring of the function name, tottime) -> where that time went
PROFILE_BUCKETS = {
    "crc32 (checksumming writer)": ("zlib.crc32",),
    "fsync (data, manifests, directory)": ("posix.fsync",),
    "os.replace / link over the previous file": ("posix.replace", "posix.link"),
    "write() into the page cache": ("'write' of '_io.BufferedWriter'", "'write' of '_io.TextIOWrapper'"),
    "torch.save serialization": ("write_record", "write_end_of_file", "PyTorchFileWriter", "'dump' of '_pickle",
                                 "serialization.py"),
    "fp16 copy of the weights": ("'half' of",),
    "tensor copies (snapshot)": ("'clone' of", "'copy_' of", "'to' of", "'cpu' of"),
}


def profile_save(fn: Callable[[], Any]) -> dict[str, float]:
    """Seconds of one save by what they were spent on (cProfile tottime of the calling thread)."""
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
        best = min(_seconds(fn) for _ in range(3))
        rates[name] = len(buf) / best / 1e9
    return rates


def _seconds(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


# --------------------------------------------------------------------------- one mode, one size


def _probe_class():
    import lightning as L

    class SaveProbe(L.Callback):
        """Runs ``fn(trainer, module)`` once, at the end of the first training batch; keeps the dict
        Lightning assembled for the last checkpoint (the one ``trainer.save_checkpoint`` writes)."""

        def __init__(self, fn: Callable[[Any, Any], None]) -> None:
            self.fn = fn
            self.checkpoint: dict[str, Any] | None = None

        def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:  # noqa: ANN001
            self.checkpoint = checkpoint

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            if batch_idx == 0:
                self.fn(trainer, pl_module)

    return SaveProbe


def measure_mode(mode: str, hidden: int, layers: int, reps: int, root: Path, data: Path, tok: Path) -> dict[str, Any]:
    """All variants, alternating, on one real Trainer whose ResumeCallback saves in ``mode``."""
    import lightning as L
    import torch

    from lit_minimind.data.datamodule import MiniMindDataModule
    from lit_minimind.model.module import LitMiniMind
    from lit_minimind.resume.io import SafeCheckpointIO

    workdir = root / mode
    mm_dir, bare_dir = workdir / "minimind", workdir / "bare"
    mm_dir.mkdir(parents=True)
    bare_dir.mkdir(parents=True)
    result: dict[str, Any] = {}

    def measure(trainer: Any, module: Any) -> None:
        optimizer = trainer.optimizers[0]
        step = int(trainer.fit_loop.epoch_loop.batch_progress.current.processed)
        stem = callback.stem(module)

        def minimind() -> dict[str, float]:
            t = time.perf_counter()
            weights = {k: v.detach().half().cpu() for k, v in module.model.state_dict().items()}
            resume = {"model": weights, "optimizer": optimizer.state_dict(), "epoch": trainer.current_epoch,
                      "step": step, "world_size": 1, "wandb_id": None, "scaler": {}}
            torch.save(weights, mm_dir / f"{stem}.pth")
            torch.save(resume, mm_dir / f"{stem}_resume.pth")
            return {"minimind": time.perf_counter() - t}

        def bare() -> dict[str, float]:
            t = time.perf_counter()
            torch.save(probe.checkpoint, bare_dir / f"{stem}.ckpt")  # the dict of our last save
            return {"bare": time.perf_counter() - t}

        def save_only() -> None:
            callback._last_saved = None  # save() skips a position it saved already
            callback.save(trainer, module)

        def ours() -> dict[str, float]:
            r0, t0 = _thread_rusage(), time.perf_counter()
            save_only()
            t1, r1 = time.perf_counter(), _thread_rusage()
            wait_for_writes(callback, trainer, module, mode)
            return {"ours": t1 - t0, "ours_written": time.perf_counter() - t0, "ours_user": r1[0] - r0[0],
                    "ours_sys": r1[1] - r0[1], "ours_minflt": r1[2] - r0[2]}

        fns = {"minimind": minimind, "bare": bare, "ours": ours}
        for key in ("ours", "minimind", "bare"):  # warm-up; ours first: bare writes the dict it captured
            timed(fns[key])
        times: dict[str, list[float]] = {}
        for rep in range(reps):
            for key in alternating(list(fns), rep):
                for name, seconds in timed(fns[key]).items():
                    times.setdefault(name, []).append(seconds)
        result["times"] = times
        result["bytes_ours"] = written_files(workdir / "checkpoints", workdir / "out")
        result["bytes_minimind"] = written_files(mm_dir)
        result["bytes_bare"] = written_files(bare_dir)
        result["rss"] = {key: peak_extra_rss(fns[key]) for key in fns}
        result["profile"] = {"ours": profile_save(save_only)}  # the stall only: the writer thread is not profiled
        wait_for_writes(callback, trainer, module, mode)
        if mode == "sync":
            result["profile"]["minimind"] = profile_save(minimind)
        result["params"] = module.model.num_parameters()
        result["snapshot_bytes"] = trainer.strategy.checkpoint_io.snapshot_bytes

    L.seed_everything(0, verbose=False)
    module = LitMiniMind(hidden_size=hidden, num_hidden_layers=layers)
    datamodule = MiniMindDataModule(data_path=str(data), tokenizer_path=str(tok), max_seq_len=16, batch_size=2)
    callback = make_callback(mode, workdir)
    probe = _probe_class()(measure)
    with quiet():
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, callbacks=[callback, probe],
                            plugins=[SafeCheckpointIO()], logger=False, default_root_dir=str(workdir),
                            use_distributed_sampler=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(module, datamodule=datamodule)
        wait_for_writes(callback, trainer, module, mode)
    if "times" not in result:
        raise RuntimeError("the save probe never ran (no training batch?)")
    del trainer, module, datamodule  # (callback: read by measure, a closure)
    _trim()
    return result


def step_time(hidden: int, layers: int, batch: int, seq: int, steps: int = 2) -> float:
    """Seconds of one training micro-batch (forward, backward, AdamW step) of this model."""
    import torch

    from lit_minimind.model import MiniMindConfig, MiniMindForCausalLM

    torch.manual_seed(0)
    model = MiniMindForCausalLM(MiniMindConfig(hidden_size=hidden, num_hidden_layers=layers))
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-4, weight_decay=0.01)
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


# --------------------------------------------------------------------------- benchmark


def summarize_mode(raw: dict[str, Any]) -> dict[str, Any]:
    t = raw["times"]
    return {
        "save_s": stats(t["ours"]),
        "save_and_write_s": stats(t["ours_written"]),
        "bare_torch_save_s": stats(t["bare"]),
        "minimind_save_s": stats(t["minimind"]),
        "stall_ratio": stats([o / b for o, b in zip(t["ours"], t["bare"])]),
        # CPU time of the training thread inside save (system time: mostly page faults of fresh memory)
        "stall_cpu_user_s": stats(t["ours_user"]), "stall_cpu_sys_s": stats(t["ours_sys"]),
        "stall_minor_faults": stats(t["ours_minflt"]),
        "stall_ratio_vs_minimind": stats([o / m for o, m in zip(t["ours"], t["minimind"])]),
        "bytes_ours": raw["bytes_ours"]["total"],
        "peak_extra_rss_bytes": raw["rss"]["ours"][0],
        "snapshot_bytes": raw["snapshot_bytes"],  # held between saves (async), reused by the next one
    }


def measure(hidden: int, layers: int, reps: int, quick: bool, data: Path, tok: Path) -> dict[str, Any]:
    name = f"{hidden}x{layers}"
    modes = ["sync", "async"] if async_supported() else ["sync"]
    headline = modes[-1]
    root = Path(tempfile.mkdtemp(prefix="bench-ckpt-", dir=cache_dir()))
    raw: dict[str, dict[str, Any]] = {}
    try:
        for mode in modes:
            say(f"  [{name}] {mode} saves: 1 training batch, warm-up, {reps} alternating repetitions ...")
            raw[mode] = measure_mode(mode, hidden, layers, reps, root, data, tok)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    batch, seq = (QUICK_STEP_BATCH, QUICK_STEP_SEQ) if quick else (STEP_BATCH, STEP_SEQ)
    step = step_time(hidden, layers, batch, seq)
    per_mode = {mode: summarize_mode(r) for mode, r in raw.items()}
    head, head_raw = per_mode[headline], raw[headline]
    ours_files, mm_files = head_raw["bytes_ours"], head_raw["bytes_minimind"]
    bytes_ratio = ours_files["total"] / mm_files["total"]
    stall = head["stall_ratio"]
    save_s = head["save_s"]["median"]
    slowdown = save_s / (SAVE_INTERVAL * step)
    ckpt_files = {k: v for k, v in ours_files["files"].items() if k.endswith(".ckpt")}
    result = {
        "model": name, "hidden_size": hidden, "num_hidden_layers": layers, "params": head_raw["params"],
        "save_mode": headline, "async_save_available": "async" in per_mode,
        # the headline numbers: the mode ResumeCallback saves in (async when it exists)
        "save_s": head["save_s"], "bare_torch_save_s": head["bare_torch_save_s"],
        "async_stall_ratio": stall, "minimind_save_s": head["minimind_save_s"],
        "target_stall_ratio": TARGET_STALL_RATIO, "target_stall_ratio_met": stall["median"] <= TARGET_STALL_RATIO,
        "bytes_ours": ours_files["total"], "bytes_minimind": mm_files["total"],
        "bytes_ratio_vs_minimind": bytes_ratio, "target_bytes_ratio": TARGET_BYTES_RATIO,
        "target_bytes_ratio_met": bytes_ratio <= TARGET_BYTES_RATIO,
        "bytes": {
            "ours_files": ours_files["files"], "ours_hard_links": ours_files["hard_links"],
            "ours_data": ours_files["data"], "ours_manifests": ours_files["manifests"],
            "ours_ckpt": sum(ckpt_files.values()),
            "ours_export": ours_files["data"] - sum(ckpt_files.values()),
            "resume_is_hard_link_to_ckpt": any(link[0].endswith("_resume.pth") and link[1].endswith(".ckpt")
                                               for link in ours_files["hard_links"]),
            "minimind_files": mm_files["files"], "bare_ckpt": head_raw["bytes_bare"]["total"],
        },
        "modes": per_mode,
        "step_s": step, "step_batch": [batch, seq],
        "slowdown_at_save_interval_1000": slowdown, "target_slowdown": TARGET_SLOWDOWN,
        "target_slowdown_met": slowdown <= TARGET_SLOWDOWN,
        "break_even_step_s_for_1pct": save_s / (SAVE_INTERVAL * TARGET_SLOWDOWN),
        "peak_extra_rss_bytes": {"minimind": raw["sync"]["rss"]["minimind"][0], "bare": raw["sync"]["rss"]["bare"][0],
                                 **{f"ours_{mode}": r["rss"]["ours"][0] for mode, r in raw.items()}},
        "rss_method": raw["sync"]["rss"]["ours"][1],
        "profile_s": {"minimind": raw["sync"]["profile"]["minimind"],
                      **{f"ours_{mode}": r["profile"]["ours"] for mode, r in raw.items()}},
    }
    say(f"  [{name}] bytes ours/MiniMind x{bytes_ratio:.2f}; MiniMind {head['minimind_save_s']['median']:.3f}s, "
        f"bare torch.save {head['bare_torch_save_s']['median']:.3f}s, "
        + ", ".join(f"ours {m} {p['save_s']['median']:.3f}s (x{p['stall_ratio']['median']:.2f})"
                    for m, p in per_mode.items())
        + f", step {step:.3f}s")
    return result


def _s(s: dict[str, Any]) -> str:
    return f"{s['median']:.3f} ({s['min']:.3f}–{s['max']:.3f})"


def render(results: list[dict[str, Any]]) -> tuple[str, str]:
    mb = 1 / 2**20
    rows = []
    for r in results:
        m, rss = r["modes"], r["peak_extra_rss_bytes"]
        sync = m["sync"]
        asy = m.get("async")
        rows.append([
            r["model"], f"{r['params'] / 1e6:.1f}M",
            f"{r['bytes_ours'] * mb:.0f} / {r['bytes_minimind'] * mb:.0f}",
            f"**{r['bytes_ratio_vs_minimind']:.2f}** (≤ {r['target_bytes_ratio']}: "
            f"{'yes' if r['target_bytes_ratio_met'] else 'NO'})",
            _s(r["minimind_save_s"]), _s(r["bare_torch_save_s"]),
            f"{_s(sync['save_s'])}, ×{sync['stall_ratio']['median']:.2f}",
            f"{_s(asy['save_s'])}, **×{asy['stall_ratio']['median']:.2f}**" if asy else "n/a (no async_save)",
            f"{rss['minimind'] * mb:.0f} / " + " / ".join(f"{rss[k] * mb:.0f}" for k in rss if k.startswith("ours_")),
        ])
    main = table(["model", "params", "MiB per save ours / MiniMind", "bytes ours ÷ MiniMind",
                  "MiniMind save s med (min–max)", "bare torch.save s", "ours sync: stall s, ÷ bare",
                  "ours async: stall s, ÷ bare", "peak extra RSS MiB MiniMind / ours sync (/ async)"], rows)
    rows2 = []
    for r in results:
        m, b = r["modes"], r["bytes"]
        rows2.append([
            r["model"],
            f"{b['ours_ckpt'] * mb:.0f} + {b['ours_export'] * mb:.0f} (+{b['ours_manifests']} B manifests)",
            f"{b['bare_ckpt'] * mb:.0f}",
            f"{m['async']['snapshot_bytes'] * mb:.0f}" if "async" in m else "n/a",
            f"×{m['sync']['stall_ratio_vs_minimind']['median']:.2f}",
            f"{m['async']['save_and_write_s']['median']:.3f}" if "async" in m else "n/a",
            " / ".join(f"{m[k]['stall_cpu_user_s']['median']:.2f} + {m[k]['stall_cpu_sys_s']['median']:.2f}"
                       for k in ("sync", "async") if k in m),
            f"{r['step_s']:.3f} ({r['step_batch'][0]}x{r['step_batch'][1]})",
            f"**{100 * r['slowdown_at_save_interval_1000']:.3f}%** ({'yes' if r['target_slowdown_met'] else 'NO'})",
            f"{r['break_even_step_s_for_1pct']:.3f}",
        ])
    detail = table(["model", "ours MiB: .ckpt + export", "bare .ckpt MiB", "async snapshot held between saves MiB",
                    "ours sync ÷ MiniMind save", "async save + write s",
                    "stall CPU user + sys s, sync / async", "step s (batch)",
                    f"slowdown @1000, {results[0]['save_mode'] if results else ''} (≤ 1%)", "1% break-even step s"],
                   rows2)
    return main, detail


def render_profile(results: list[dict[str, Any]]) -> str:
    buckets = [*PROFILE_BUCKETS, "everything else", "total"]
    sides = [(r, side) for r in results for side in r["profile_s"]]
    headers = ["one save (cProfile, calling thread), s"] + [f"{r['model']} {side}" for r, side in sides]
    rows = [[b] + [f"{r['profile_s'][side][b]:.3f}" for r, side in sides] for b in buckets]
    return table(headers, rows)


def plot(results: list[dict[str, Any]], path: Path) -> Path:
    plt = pyplot()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.4), gridspec_kw={"width_ratios": [3, 1.3]})
    keys = [("minimind_save_s", "sync", "MiniMind save (2 files)"), ("bare_torch_save_s", "sync", "bare torch.save"),
            ("save_s", "sync", "ResumeCallback.save, sync"),
            ("save_s", "async", "ResumeCallback.save, async (stall)"),
            ("save_and_write_s", "async", "async save + background write")]
    keys = [k for k in keys if any(k[1] in r["modes"] for r in results)]
    width = 0.8 / max(1, len(results))
    for i, r in enumerate(results):
        vals = [r["modes"].get(mode, {}).get(key) for key, mode, _ in keys]
        med = [v["median"] if v else 0 for v in vals]
        err = [[v["median"] - v["min"] if v else 0 for v in vals], [v["max"] - v["median"] if v else 0 for v in vals]]
        ax.barh([j + i * width for j in range(len(keys))], med, width, xerr=err, capsize=2,
                label=f"{r['model']} ({r['params'] / 1e6:.0f}M)")
        bx.bar([0 + i * width, 1 + i * width], [r["bytes_minimind"] / 2**20, r["bytes_ours"] / 2**20], width)
    ax.set_yticks([j + width * (len(results) - 1) / 2 for j in range(len(keys))], [k[2] for k in keys], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds per save (median, min–max)")
    ax.set_title("checkpoint save: training-loop stall")
    ax.legend(fontsize=8)
    bx.set_xticks([width * (len(results) - 1) / 2, 1 + width * (len(results) - 1) / 2], ["MiniMind", "ours"])
    bx.set_ylabel("MiB written per save")
    bx.set_title("bytes per save")
    return save_figure(fig, path)


def run(quick: bool = False, results_dir: Path = RESULTS_DIR, reps: int | None = None,
        threads: int | None = None) -> dict[str, Any]:
    threads = set_threads(threads)
    reps = reps or (2 if quick else 5)
    sizes = QUICK_SIZES if quick else FULL_SIZES
    data, tok = default_data()
    available = async_supported()
    say(f"== checkpoint cost ({reps} alternating repetitions after warm-up, {threads} torch thread(s); "
        f"ResumeCallback async_save: {'sync and async measured' if available else 'not available, sync only'}) ==")
    results = [measure(h, n, reps, quick, data, tok) for h, n in sizes]
    rates = digest_rates(8 if quick else 64)
    main_table, detail_table = render(results)
    profile_table = render_profile(results)
    text = main_table + "\n\n" + detail_table + "\n\n" + profile_table
    say(text)
    say("per-byte work on this machine: " + ", ".join(f"{k} {v:.2f} GB/s" for k, v in rates.items()))
    payload = {"benchmark": "checkpoint", "quick": quick, "reps": reps, "threads": threads,
               "environment": environment(), "disk_dir": rel(cache_dir()), "variants": VARIANTS,
               "async_save_available": available, "results": results, "table": main_table,
               "detail_table": detail_table, "profile_table": profile_table, "rates_gb_per_s": rates}
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
