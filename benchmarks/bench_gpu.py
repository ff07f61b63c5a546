"""GPU benchmark (``make bench-gpu``): throughput and MFU, exact kill-and-resume, determinism, save stall.

One prepared script for one CUDA GPU (H100/H200 class): one overall deadline (8 minutes: what is not
done by then is reported as not run, and the exit status is 1), each CLI child at most 120 s; run
with a prepared CUDA environment, no install step (``make bench-gpu PY=/path/to/python``). MiniMind's pretraining
shape (768x8, seq 340, batch 32, bf16-mixed) on synthetic data (pages of the embedded corpus
joined into long texts, so every sequence is full), accumulation 1:

(a) **throughput and MFU** of the port (``python -m lit_minimind.fit``, ``--trainer.max_steps`` 200,
    no save inside the timed window) against the plain PyTorch loop of the same training
    (:func:`benchmarks.bench_overhead.plain_run` on the GPU, bf16 autocast, deterministic
    algorithms as the port's default, the same data loader workers). MFU = 6 x parameters x
    tokens/s / the device's dense bf16 peak (table below; unknown device: tokens/s only, MFU null;
    attention's own FLOPs are not counted). The timed window excludes the first batches
    (warm-up) and synchronizes the device at both ends.
(b) **kill and resume, bit for bit**, with ``16-mixed`` (CUDA GradScaler) and with ``bf16-mixed``:
    an uninterrupted run (200 steps, a save every 100) against one SIGKILLed right after its first
    checkpoint is committed (the test hook ``LIT_MINIMIND_TEST_STOP_AFTER_SAVE=1:.ckpt`` stops the
    process there, with an async save while training goes on; then SIGKILL) and resumed with
    ``--ckpt_path last``: the fp16 export ``out/{stem}.pth``, the resume checkpoint's
    ``state_dict`` and optimizer state, and the console lines must be identical.
(c) **determinism**: a second uninterrupted bf16 run with the default ``--trainer.deterministic
    true`` must equal the first bit for bit (and so must one with ``--resume.async_save false``);
    tokens/s with ``--trainer.deterministic false`` against the default, in (a)'s rotation: the cost
    of deterministic kernels.
(d) **async save stall** at ``--resume.save_interval 100``: time the training loop is held by each
    save (device synchronized before and after it) with the default asynchronous save and with
    ``--resume.async_save false``; also the timed window's excess over (a)'s no-save step time,
    per save (what the background write costs the loop, GIL and copies included).

``--quick`` is a CPU smoke test (tests/test_benchmarks.py): a tiny model, the CPU accelerator,
``32-true`` in place of bf16-mixed and ``lit_minimind.model.precision.CPUFloat16Mixed`` (fp16 with a CPU
GradScaler) in place of 16-mixed; its numbers are not GPU results and its JSON says so
(``gpu_results: false``, written as ``gpu_quick.json``). Without CUDA and without ``--quick`` it
exits with status 2 and one line; when a bit-for-bit check fails, with status 1 (after writing the
results).

``python -m benchmarks.bench_gpu [--quick] [--reps N] [--jobs N] [--peak-tflops X] [--results-dir DIR]``
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import (
    CONSOLE_LINE_RE,
    RESULTS_DIR,
    ROOT,
    alternating,
    bench_parser,
    cache_dir,
    default_data,
    environment,
    fmt_num,
    quiet,
    rel,
    say,
    set_threads,
    stats,
    synthetic_jsonl,
    table,
    write_json,
)

# dense (no sparsity) bf16 tensor-core peak by a substring of torch.cuda.get_device_name(); first match wins
PEAK_BF16_FLOPS: list[tuple[str, float]] = [
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("A100", 312e12),
]
NO_GPU = ("bench_gpu: no CUDA device (torch.cuda.is_available() is False); this benchmark needs one GPU "
          "(python -m benchmarks.bench_gpu --quick is its CPU smoke test)")


@dataclass
class Spec:
    name: str
    hidden_size: int
    num_hidden_layers: int
    max_seq_len: int
    batch_size: int
    accumulate: int
    learning_rate: float
    accelerator: str
    # (a): steps per run, micro-batches before the timed window, console interval
    throughput_steps: int
    warmup_batches: int
    log_interval: int
    # (b)-(d): steps per run, save interval, console interval (lines compared after a resume)
    resume_steps: int
    save_interval: int
    resume_log_interval: int
    num_workers: int
    lines: int  # synthetic jsonl
    reps: int
    # (label, CLI flags) of the two precisions of (b): the main one first (also (a), (c), (d))
    precisions: list[tuple[str, list[str]]] = field(default_factory=list)
    plain_precision: str = "bf16-mixed"
    jobs: int = 1  # (b)-(d) runs at once (GPU: 1, the stall is timed)
    child_timeout_s: float = 120.0  # one CLI process at most
    deadline_s: float = 480.0  # the whole benchmark: later children are not started, and reported as not run


GPU = Spec("MiniMind pretrain 768x8", 768, 8, 340, 32, 1, 5e-4, "gpu",
           throughput_steps=200, warmup_batches=30, log_interval=100,
           resume_steps=200, save_interval=100, resume_log_interval=10,
           num_workers=4, lines=12_800, reps=2,
           precisions=[("bf16-mixed", ["--trainer.precision", "bf16-mixed"]),
                       ("16-mixed", ["--trainer.precision", "16-mixed"])])
QUICK = Spec("quick 64x1 (CPU smoke test)", 64, 1, 32, 4, 1, 1e-3, "cpu",
             throughput_steps=12, warmup_batches=3, log_interval=4,
             resume_steps=12, save_interval=4, resume_log_interval=1,
             num_workers=0, lines=256, reps=1,
             precisions=[("32-true", ["--trainer.precision", "32-true"]),
                         ("16-mixed (CPUFloat16Mixed)", ["--trainer.plugins", "lit_minimind.model.precision.CPUFloat16Mixed"])],
             plain_precision="32-true", jobs=2, child_timeout_s=600.0, deadline_s=1800.0)


class NoGPU(RuntimeError):
    pass


class DeadlineReached(RuntimeError):
    pass


_LIMITS = {"deadline": float("inf"), "child_s": 600.0}  # set by run() from the Spec


def child_timeout() -> float:
    """Seconds the next CLI child may run: the per-child limit, or what is left of the overall deadline."""
    left = _LIMITS["deadline"] - time.monotonic()
    if left < 5:
        raise DeadlineReached("not run: the benchmark's overall deadline was reached")
    return min(_LIMITS["child_s"], left)


# --------------------------------------------------------------------------- inputs


def long_texts_jsonl(lines: int) -> Path:
    """A pretrain jsonl of ``lines`` texts of 2,400-3,000 characters, so every sequence of 340 tokens is full."""
    return synthetic_jsonl(lines, 2400, 3000, seed=7)


def peak_flops(device: str, override_tflops: float | None = None) -> float | None:
    if override_tflops:
        return override_tflops * 1e12
    return next((flops for key, flops in PEAK_BF16_FLOPS if key.lower() in device.lower()), None)


# --------------------------------------------------------------------------- the CLI, in a subprocess


def cli_args(spec: Spec, data: Path, tok: Path, work: Path, steps: int, log_interval: int, save_interval: int,
             precision: list[str], *extra: str) -> list[str]:
    return [
        "--model.hidden_size", str(spec.hidden_size), "--model.num_hidden_layers", str(spec.num_hidden_layers),
        "--model.learning_rate", str(spec.learning_rate),
        "--data.data_path", str(data), "--data.tokenizer_path", str(tok),
        "--data.max_seq_len", str(spec.max_seq_len), "--data.batch_size", str(spec.batch_size),
        "--data.num_workers", str(spec.num_workers),
        "--trainer.accelerator", spec.accelerator, "--trainer.devices", "1",
        "--trainer.max_epochs", "1", "--trainer.max_steps", str(steps),
        "--trainer.accumulate_grad_batches", str(spec.accumulate),
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
        "--trainer.default_root_dir", str(work),
        "--log_interval", str(log_interval), "--resume.save_interval", str(save_interval),
        "--resume.out_dir", str(work / "out"), "--resume.ckpt_dir", str(work / "checkpoints"),
        *precision, *extra,
    ]


def child_env(warmup: int, **extra: str) -> dict[str, str]:
    # CUBLAS_WORKSPACE_CONFIG is the plain loop's (this process); Lightning sets it itself when deterministic
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIT_MINIMIND_TEST") and k != "CUBLAS_WORKSPACE_CONFIG"}
    # tests/helpers/site: the test-only pause after a save (kill_after_save) is installed from there
    env.update({"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests" / "helpers" / "site")]),
                "LIT_MINIMIND_CACHE": str(cache_dir()), "PYTHONUNBUFFERED": "1",
                "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled", "BENCH_GPU_WARMUP": str(warmup), **extra})
    return env


def cli(args: list[str], work: Path, warmup: int = 1, kill_after_save: bool = False,
        timeout: float | None = None) -> dict[str, Any]:
    """Run the CLI (through :mod:`benchmarks._gpu_probe`) in ``work``. ``kill_after_save``: the process
    stops itself right after its first checkpoint is committed and is SIGKILLed there. Killed after
    ``timeout`` (default :func:`child_timeout`), which raises."""
    timeout = child_timeout() if timeout is None else timeout
    work.mkdir(parents=True, exist_ok=True)
    env = child_env(warmup, **({"LIT_MINIMIND_TEST_STOP_AFTER_SAVE": "1:.ckpt"} if kill_after_save else {}))
    start = time.perf_counter()
    with open(work / "stderr.txt", "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "benchmarks._gpu_probe", *args], cwd=work, env=env,
                                stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
        watchdog = threading.Timer(timeout, _kill_group, (proc.pid,))
        watchdog.start()
        probe, lines, stopped, tail = None, {}, None, []
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.startswith("@@gpu "):
                    probe = json.loads(line[len("@@gpu "):])
                    continue
                if line.startswith("@@stopped-after-save"):
                    stopped = line.split(maxsplit=1)[1].strip()
                    _kill_group(proc.pid)  # the trainer and its data loader workers
                    break
                tail = (tail + [line])[-20:]
                m = CONSOLE_LINE_RE.search(line)
                if m:
                    lines[f"{m[1]}:{m[3]}"] = [m[5], m[6], m[7], m[8]]
            proc.wait()
        finally:
            watchdog.cancel()
    wall = time.perf_counter() - start
    if wall >= timeout and stopped is None:
        raise DeadlineReached(f"killed after {timeout:.0f} s (a child's limit or the overall deadline) in {work}")
    killed = stopped is not None and proc.returncode == -signal.SIGKILL
    if kill_after_save and not killed:
        raise RuntimeError(f"the run was to stop after its first save (exit {proc.returncode}):\n"
                           + "".join(tail) + (work / "stderr.txt").read_text()[-3000:])
    if not kill_after_save and (proc.returncode != 0 or probe is None):
        raise RuntimeError(f"CLI run failed (exit {proc.returncode}) in {work}:\n" + "".join(tail)
                           + (work / "stderr.txt").read_text()[-3000:])
    return {"returncode": proc.returncode, "probe": probe, "lines": lines, "stopped_after": stopped, "wall_s": wall}


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def saved_step(path: str | None) -> int | None:
    m = re.search(r"_s(\d+)_g(\d+)", path or "")
    return int(m[2]) if m else None


# --------------------------------------------------------------------------- bit-for-bit comparison


def bitwise_equal(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        return bool(torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8)))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(bitwise_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(bitwise_equal(x, y) for x, y in zip(a, b))
    return a == b


def max_abs_diff(a: dict[str, Any], b: dict[str, Any]) -> float | None:
    import torch

    diffs = [float((a[k].float() - b[k].float()).abs().max()) for k in a
             if k in b and isinstance(a[k], torch.Tensor) and a[k].is_floating_point() and a[k].shape == b[k].shape
             and a[k].numel()]
    return max(diffs) if diffs else None


def compare_runs(a: Path, b: Path, stem: str, lines_a: dict[str, Any], lines_b: dict[str, Any]) -> dict[str, Any]:
    """Export, resume checkpoint (``state_dict``, optimizer, GradScaler, data position, global step) and
    the console lines both printed (loss, logits loss, aux loss, lr) of two runs."""
    import torch

    ea = torch.load(a / "out" / f"{stem}.pth", map_location="cpu", weights_only=True)
    eb = torch.load(b / "out" / f"{stem}.pth", map_location="cpu", weights_only=True)
    ra = torch.load(a / "checkpoints" / f"{stem}_resume.pth", map_location="cpu", weights_only=True)
    rb = torch.load(b / "checkpoints" / f"{stem}_resume.pth", map_location="cpu", weights_only=True)
    common = sorted(set(lines_a) & set(lines_b))
    result = {
        "export_equal": bitwise_equal(ea, eb),
        "state_dict_equal": bitwise_equal(ra["state_dict"], rb["state_dict"]),
        "optimizer_equal": bitwise_equal(ra.get("optimizer_states"), rb.get("optimizer_states")),
        "scaler_equal": bitwise_equal(ra.get("scaler"), rb.get("scaler")),
        "data_position_equal": bitwise_equal(ra.get("MiniMindDataModule"), rb.get("MiniMindDataModule")),
        "global_step": [ra.get("global_step"), rb.get("global_step")],
        "state_dict_max_abs_diff": max_abs_diff(ra["state_dict"], rb["state_dict"]),
        "console_lines_compared": len(common),
        "console_lines_equal": all(lines_a[k] == lines_b[k] for k in common),
        "tensors": len(ra["state_dict"]),
    }
    result["identical"] = all(result[k] for k in ("export_equal", "state_dict_equal", "optimizer_equal",
                                                  "scaler_equal", "data_position_equal", "console_lines_equal")) \
        and result["global_step"][0] == result["global_step"][1] and len(common) > 0
    return result


# --------------------------------------------------------------------------- (a) throughput


def throughput_phase(spec: Spec, data: Path, tok: Path, work: Path, reps: int, cuda: bool,
                     peak: float | None, jobs: int = 1) -> dict[str, Any]:
    import torch

    from benchmarks.bench_overhead import Config, plain_run, throughput

    steps = spec.throughput_steps
    cfg = Config(spec.name, spec.hidden_size, spec.num_hidden_layers, spec.max_seq_len, spec.batch_size, spec.accumulate,
                 spec.learning_rate, warmup_batches=spec.warmup_batches,
                 timed_batches=steps * spec.accumulate - spec.warmup_batches, log_interval=spec.log_interval)
    main_precision = spec.precisions[0][1]
    sides = ("plain", "port", "port_nondeterministic")
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in sides}

    def plain() -> dict[str, Any]:
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        with quiet():
            r = plain_run(cfg, data, tok, device="cuda" if cuda else "cpu", precision=spec.plain_precision,
                          num_workers=spec.num_workers, deterministic=True)
        torch.use_deterministic_algorithms(False)
        peak_memory = int(torch.cuda.max_memory_allocated()) if cuda else None
        if cuda:
            torch.cuda.empty_cache()
        return {"tokens_per_s": throughput(cfg, r, 0), "last_loss": r["last_loss"],
                "probe": {"peak_memory_bytes": peak_memory, "deterministic": True}}

    def port(side: str, rep: int) -> dict[str, Any]:
        extra = ["--trainer.deterministic", "false"] if side == "port_nondeterministic" else []
        d = work / f"a_{side}_{rep}"
        out = cli(cli_args(spec, data, tok, d, steps, spec.log_interval, 10**9, main_precision, *extra), d,
                  warmup=spec.warmup_batches)
        shutil.rmtree(d, ignore_errors=True)
        p = out["probe"]
        assert p["window_batches"] == cfg.timed_batches, (p["window_batches"], cfg.timed_batches)
        return {"tokens_per_s": p["window_batches"] * p["tokens_per_batch"] / p["window_s"],
                "last_loss": p["last_loss"], "probe": p, "wall_s": out["wall_s"]}

    for rep in range(reps):
        order = alternating(sides, rep)
        if jobs > 1:  # --quick: the CLI runs side by side with the plain loop (the numbers mean nothing anyway)
            with ThreadPoolExecutor(max_workers=jobs) as pool:
                futures = {side: pool.submit(port, side, rep) for side in order if side != "plain"}
                runs["plain"].append(plain())
                for side, future in futures.items():
                    runs[side].append(future.result())
        else:  # one at a time, in rotated order
            for side in order:
                runs[side].append(plain() if side == "plain" else port(side, rep))
        for side in order:
            say(f"  [a: throughput] rep {rep + 1}/{reps} {side}: {runs[side][-1]['tokens_per_s']:,.0f} tok/s")
    probe = runs["port"][0]["probe"]
    params = probe["params"]
    result: dict[str, Any] = {"config": asdict(cfg), "params": params, "device": probe["device"],
                              "peak_bf16_flops": peak, "sides": {}}
    for side in sides:
        tps = stats([r["tokens_per_s"] for r in runs[side]])
        result["sides"][side] = {
            "tokens_per_s": tps,
            "ms_per_batch": 1000 * cfg.tokens_per_batch / tps["median"],
            "mfu": 6 * params * tps["median"] / peak if peak else None,
            "last_loss": [r["last_loss"] for r in runs[side]],
            "peak_memory_bytes": max((r["probe"]["peak_memory_bytes"] or 0) for r in runs[side]) or None,
            "deterministic": runs[side][0]["probe"]["deterministic"],
        }
    ratio = [p["tokens_per_s"] / q["tokens_per_s"] for p, q in zip(runs["port"], runs["plain"])]
    det = [p["tokens_per_s"] / q["tokens_per_s"] for p, q in zip(runs["port_nondeterministic"], runs["port"])]
    result["port_over_plain"] = stats(ratio)
    result["nondeterministic_over_default"] = stats(det)
    result["last_loss_diff_port_plain"] = max(abs(p["last_loss"] - q["last_loss"]) for p, q in zip(runs["port"], runs["plain"]))
    return result


# --------------------------------------------------------------------------- (b)-(d)


def exactness_phase(spec: Spec, data: Path, tok: Path, work: Path, jobs: int) -> dict[str, Any]:
    from lit_minimind.checkpoint.names import checkpoint_stem

    stem = checkpoint_stem("pretrain", spec.hidden_size, False)
    steps, interval, log = spec.resume_steps, spec.save_interval, spec.resume_log_interval
    (main_label, main_flags), (fp16_label, fp16_flags) = spec.precisions

    def args(d: Path, flags: list[str], *extra: str) -> list[str]:
        return cli_args(spec, data, tok, d, steps, log, interval, flags, *extra)

    def uninterrupted(name: str, flags: list[str], *extra: str) -> dict[str, Any]:
        d = work / name
        return {"dir": d, **cli(args(d, flags, *extra), d, warmup=spec.warmup_batches)}

    def kill_and_resume(name: str, flags: list[str]) -> dict[str, Any]:
        d = work / name
        killed = cli(args(d, flags), d, kill_after_save=True)
        resumed = cli(args(d, flags, "--ckpt_path", "last"), d, warmup=1)
        lines = dict(killed["lines"])  # steps trained again after the resume must print the same line
        for key, value in resumed["lines"].items():
            lines[key] = value if lines.get(key, value) == value else ["differs between the killed and the resumed run"]
        return {"dir": d, "killed": killed, "resumed": resumed, "lines": lines,
                "wall_s": killed["wall_s"] + resumed["wall_s"]}

    tasks = {  # the most important first: what the deadline cuts off is reported as not run
        "main": lambda: uninterrupted("main", main_flags),
        "main_again": lambda: uninterrupted("main_again", main_flags),
        "main_kill": lambda: kill_and_resume("main_kill", main_flags),
        "fp16": lambda: uninterrupted("fp16", fp16_flags),
        "fp16_kill": lambda: kill_and_resume("fp16_kill", fp16_flags),
        "main_sync_save": lambda: uninterrupted("main_sync_save", main_flags, "--resume.async_save", "false"),
    }

    def guarded(name: str) -> dict[str, Any]:
        try:
            return tasks[name]()
        except RuntimeError as err:  # a failed or timed-out child (DeadlineReached included)
            return {"error": str(err).splitlines()[0][:500], "wall_s": 0.0}

    done: dict[str, dict[str, Any]] = {}
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = {name: pool.submit(guarded, name) for name in tasks}
        for name, future in futures.items():
            done[name] = future.result()
            say(f"  [b-d: exactness, stall] {name}: " + (f"FAILED: {done[name]['error']}" if "error" in done[name]
                                                          else f"done in {done[name]['wall_s']:.0f} s"))

    def compared(ref: str, other: str) -> dict[str, Any]:
        errors = [f"{n}: {done[n]['error']}" for n in (ref, other) if "error" in done[n]]
        if errors:
            return {"identical": False, "error": "; ".join(errors)}
        return compare_runs(done[ref]["dir"], done[other]["dir"], stem, done[ref]["lines"], done[other]["lines"])

    def resume_check(ref: str, kr: str) -> dict[str, Any]:
        out = compared(ref, kr)
        if "error" in out:
            return out
        k = done[kr]
        out["killed_after_save_at_step"] = saved_step(k["killed"]["stopped_after"])
        out["killed_at_last_console_step"] = max((int(key.split(":")[1]) for key in k["killed"]["lines"]), default=0)
        out["resumed_first_console_step"] = min((int(key.split(":")[1]) for key in k["resumed"]["lines"]), default=None)
        return out

    resume = {main_label: resume_check("main", "main_kill"), fp16_label: resume_check("fp16", "fp16_kill")}
    determinism = {
        "two_uninterrupted_runs": compared("main", "main_again"),
        "async_vs_sync_save": compared("main", "main_sync_save"),
        "deterministic_flags": ({k: done["main"]["probe"][k] for k in ("deterministic", "deterministic_warn_only")}
                                if "error" not in done["main"] else None),
    }
    ckpts = sorted((work / "main" / "checkpoints").glob(f"{stem}_e*.ckpt"))
    export = work / "main" / "out" / f"{stem}.pth"
    stall = {"runs": {name: done[name]["probe"] for name in ("main", "main_again", "main_sync_save")
                      if "error" not in done[name]},
             "checkpoint_bytes": ckpts[-1].stat().st_size if ckpts else None,
             "export_bytes": export.stat().st_size if export.exists() else None}
    for d in work.iterdir():
        shutil.rmtree(d, ignore_errors=True)
    return {"stem": stem, "steps": steps, "save_interval": interval, "resume": resume, "determinism": determinism,
            "stall": stall}


def stall_summary(stall: dict[str, Any], base_s_per_batch: float, save_interval: int) -> dict[str, Any]:
    """Per save mode: the loop held inside each save, and the timed window's excess over no-save batches."""
    out: dict[str, Any] = {}
    for mode, names in (("async", ("main", "main_again")), ("sync", ("main_sync_save",))):
        held, excess = [], []
        for name in (n for n in names if n in stall["runs"]):
            p = stall["runs"][name]
            inside = [s for s in p["saves"] if p["window_start"] <= s["start"] <= p["window_end"]]
            held += [s["s"] for s in inside]
            if inside:
                excess.append((p["window_s"] - p["window_batches"] * base_s_per_batch) / len(inside))
        if held:
            out[mode] = {"saves": len(held), "held_s": stats(held),
                         "window_excess_per_save_s": stats(excess) if excess else None,
                         "slowdown_at_interval": stats(held)["median"] / (save_interval * base_s_per_batch)}
    return out


# --------------------------------------------------------------------------- report


def render(payload: dict[str, Any]) -> str:
    a, ex = payload["throughput"], payload["exactness"]
    out = [f"not run or failed: {e}" for e in payload.get("errors", [])]
    if a is not None:
        out += render_throughput(a)
    if ex is not None:
        out += render_exactness(payload, ex)
    return "\n".join(out)


def render_throughput(a: dict[str, Any]) -> list[str]:
    pct = lambda x: "–" if x is None else f"{100 * x:.1f} %"  # noqa: E731
    labels = {"plain": "plain PyTorch loop (deterministic, as the port's default)",
              "port": "port: python -m lit_minimind.fit (default --trainer.deterministic true)",
              "port_nondeterministic": "port, --trainer.deterministic false"}
    rows = []
    for side, r in a["sides"].items():
        t = r["tokens_per_s"]
        vs = {"plain": "1", "port": f"{a['port_over_plain']['median']:.3f}",
              "port_nondeterministic": f"{a['port_over_plain']['median'] * a['nondeterministic_over_default']['median']:.3f}"}[side]
        mem = f"{r['peak_memory_bytes'] / 2**30:.1f}" if r["peak_memory_bytes"] else "–"
        rows.append([labels[side], f"{fmt_num(t['median'])} ({fmt_num(t['min'])}–{fmt_num(t['max'])})",
                     f"{r['ms_per_batch']:.1f}", pct(r["mfu"]), vs, mem])
    peak = f"{a['peak_bf16_flops'] / 1e12:.0f} TFLOPS" if a["peak_bf16_flops"] else "unknown: no MFU"
    out = [f"(a) throughput, {a['config']['name']}, {a['params'] / 1e6:.1f}M params, batch {a['config']['batch_size']}x"
           f"{a['config']['max_seq_len']}, on {a['device']} (dense bf16 peak {peak})",
           table(["side", "tok/s med (min–max)", "ms / micro-batch", "MFU (6N)", "÷ plain", "peak GPU GiB"], rows),
           f"port / plain {a['port_over_plain']['median']:.3f}; --trainer.deterministic false / default "
           f"{a['nondeterministic_over_default']['median']:.3f}; Δ last loss port vs plain {a['last_loss_diff_port_plain']:.1e}",
           ""]
    return out


def render_exactness(payload: dict[str, Any], ex: dict[str, Any]) -> list[str]:
    yes = lambda b: "**yes**" if b else "**NO**"  # noqa: E731
    rows = []
    for label, r in ex["resume"].items():
        if "error" in r:
            rows.append([f"(b) kill + resume --ckpt_path last, {label}", yes(False), r["error"][:200]])
            continue
        rows.append([f"(b) kill + resume --ckpt_path last, {label}", yes(r["identical"]),
                     f"SIGKILL after the save at step {r['killed_after_save_at_step']} (console at step "
                     f"{r['killed_at_last_console_step']}); export {yes(r['export_equal'])}, state_dict "
                     f"{yes(r['state_dict_equal'])}, optimizer {yes(r['optimizer_equal'])}, scaler "
                     f"{yes(r['scaler_equal'])}, {r['console_lines_compared']} console lines equal "
                     f"{yes(r['console_lines_equal'])}"])
    d = ex["determinism"]
    for key, text in (("two_uninterrupted_runs", "(c) two uninterrupted runs, default deterministic"),
                      ("async_vs_sync_save", "(c) async vs --resume.async_save false")):
        r = d[key]
        if "error" in r:
            rows.append([text, yes(False), r["error"][:200]])
            continue
        rows.append([text, yes(r["identical"]), f"export {yes(r['export_equal'])}, state_dict {yes(r['state_dict_equal'])}"
                     f", optimizer {yes(r['optimizer_equal'])}, max |Δ| {r['state_dict_max_abs_diff']}"])
    out = [f"(b)/(c) bit-for-bit checks ({ex['steps']} steps, a save every {ex['save_interval']}):",
            table(["check", "identical", "detail"], rows), ""]
    rows = []
    for mode, s in (payload.get("save_stall") or {}).items():
        w = s["window_excess_per_save_s"]
        rows.append([mode, s["saves"], f"{s['held_s']['median']:.3f} ({s['held_s']['min']:.3f}–{s['held_s']['max']:.3f})",
                     f"{w['median']:.3f}" if w else "–", f"{100 * s['slowdown_at_interval']:.2f} %"])
    if rows:
        out += [f"(d) save stall at --resume.save_interval {ex['save_interval']} (checkpoint "
                f"{(ex['stall']['checkpoint_bytes'] or 0) / 2**20:.0f} MiB + export "
                f"{(ex['stall']['export_bytes'] or 0) / 2**20:.0f} MiB; no-save step {payload['base_ms_per_batch']:.1f} ms):",
                table(["save", "saves timed", "loop held per save s med (min–max)", "window excess per save s",
                       f"held ÷ {ex['save_interval']} steps"], rows)]
    return out


def run(quick: bool = False, results_dir: Path = RESULTS_DIR, reps: int | None = None, threads: int | None = None,
        jobs: int | None = None, peak_tflops: float | None = None) -> dict[str, Any]:
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not quick:
        raise NoGPU(NO_GPU)
    spec = QUICK if quick else GPU
    reps = reps or spec.reps
    jobs = jobs or spec.jobs
    threads = set_threads(threads)
    if not quick:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # the plain loop's deterministic cuBLAS (this process)
    start = time.perf_counter()
    _LIMITS.update(deadline=time.monotonic() + spec.deadline_s, child_s=spec.child_timeout_s)
    _, tok = default_data()
    data = long_texts_jsonl(spec.lines)
    device = torch.cuda.get_device_name() if cuda and not quick else "CPU (--quick)"
    peak = peak_flops(device, peak_tflops) if not quick else None
    say(f"== GPU benchmark{' (--quick: CPU smoke test, not GPU results)' if quick else ''}: {spec.name} on {device} ==")
    work = Path(tempfile.mkdtemp(prefix="bench-gpu-", dir=cache_dir()))
    a, ex, errors = None, None, []
    try:
        try:
            a = throughput_phase(spec, data, tok, work, reps, cuda and not quick, peak, jobs)
        except RuntimeError as err:  # a failed or timed-out child: (b)-(d) still run, in what time is left
            errors.append(f"(a) throughput: {str(err).splitlines()[0][:500]}")
        ex = exactness_phase(spec, data, tok, work, jobs)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base = a["sides"]["port"]["ms_per_batch"] / 1000 if a is not None else None
    payload = {
        "benchmark": "gpu", "quick": quick, "gpu_results": not quick, "reps": reps, "threads": threads, "jobs": jobs,
        "environment": {**environment(), "cuda": torch.version.cuda, "device": device},
        "data": rel(data), "tokenizer": rel(tok), "spec": asdict(spec),
        "throughput": a, "exactness": ex, "base_ms_per_batch": 1000 * base if base else None,
        "save_stall": stall_summary(ex["stall"], base, spec.save_interval) if base else None,
        "wall_s": time.perf_counter() - start, "deadline_s": spec.deadline_s, "child_timeout_s": spec.child_timeout_s,
        "errors": errors,
    }
    payload["all_identical"] = not errors and all(r["identical"] for r in ex["resume"].values()) and all(
        ex["determinism"][k]["identical"] for k in ("two_uninterrupted_runs", "async_vs_sync_save"))
    payload["table"] = render(payload)
    say(payload["table"])
    say(f"{'quick CPU smoke test' if quick else 'GPU benchmark'}: {payload['wall_s']:.0f} s; every bit-for-bit check "
        f"{'passed' if payload['all_identical'] else 'did NOT pass'}")
    write_json(results_dir / ("gpu_quick.json" if quick else "gpu.json"), payload)
    return payload


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, "repetitions of the throughput rotation (default 2, quick 1)")
    parser.add_argument("--jobs", type=int, default=None, help="(b)-(d) runs at once (default 1; quick 2)")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the device's dense bf16 peak in TFLOPS, for MFU (default: from the built-in table)")
    args = parser.parse_args(argv)
    try:
        payload = run(args.quick, args.results_dir, args.reps, args.threads, args.jobs, args.peak_tflops)
    except NoGPU as err:
        print(err, file=sys.stderr)
        return 2
    return 0 if payload["all_identical"] else 1  # a bit-for-bit check failed


if __name__ == "__main__":
    raise SystemExit(main())
