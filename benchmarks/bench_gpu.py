"""GPU benchmark (make bench-gpu): throughput and MFU, exact kill-and-resume, determinism, save stall.

One prepared script for one CUDA GPU (benchmarks/README.md has the details): an 8-minute deadline (what is not done by
then is reported as not run, exit 1), each child at most 120 s, MiniMind's pretraining shape (768x8, seq 340, batch
32, bf16-mixed). (a) tokens/s and MFU (6 x params x tokens/s / the dense bf16 peak) of the CLI vs the plain loop and
vs ``--trainer.deterministic false``; (b) a run SIGKILLed once its first save is written, resumed with ``--ckpt_path
last``, against an uninterrupted one, bit for bit (bf16-mixed, 16-mixed); (c) two uninterrupted runs, and async vs
sync save, bit for bit; (d) the loop's wait per save. ``--quick``: a CPU smoke test (``gpu_quick.json``). No CUDA
without ``--quick``: exit 2.
"""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks import common as bc
from benchmarks.bench_overhead import Config, compare

NAME = "gpu"
ARGS = [(["--peak-tflops"], {"type": float, "default": None, "help": "the device's dense bf16 peak (TFLOPS), for MFU"})]
# dense (no sparsity) bf16 tensor-core peak by a substring of torch.cuda.get_device_name(); first match wins
PEAK_BF16_FLOPS = [("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("H200", 989e12), ("A100", 312e12)]
NO_GPU = ("bench_gpu: no CUDA device (torch.cuda.is_available() is False); this benchmark needs one GPU "
          "(python -m benchmarks.bench_gpu --quick is its CPU smoke test)")
RUNS = ["main", "main_again", "main_kill", "fp16", "fp16_kill", "main_sync_save"]  # what the deadline cuts: last


@dataclass
class Spec:
    cfg: Config  # (a): model, data shape, precision, workers; its batches: warm-up + timed
    resume_steps: int  # (b)-(d): steps per run, save interval, console interval (lines compared after a resume)
    save_interval: int
    resume_log_interval: int
    lines: int  # synthetic jsonl
    reps: int
    precisions: list[tuple[str, list[str]]]  # (label, CLI flags) of (b): the main one first
    jobs: int = 1  # (b)-(d) runs at once (GPU: 1, the stall is timed)
    child_timeout_s: float = 120.0
    deadline_s: float = 480.0  # later children are not started, and reported as not run


GPU = Spec(Config("MiniMind pretrain 768x8", 768, 8, 340, 32, 1, 5e-4, 30, 170, log_interval=100, accelerator="gpu",
                  precision="bf16-mixed", num_workers=4), 200, 100, 10, 12_800, 2,
           [("bf16-mixed", ["--trainer.precision", "bf16-mixed"]), ("16-mixed", ["--trainer.precision", "16-mixed"])])
QUICK = Spec(Config("quick 64x1 (CPU smoke test)", 64, 1, 32, 4, 1, 1e-3, 3, 9, log_interval=4), 12, 4, 1, 256, 1,
             [("32-true", ["--trainer.precision", "32-true"]),
              ("16-mixed (CPUFloat16Mixed)", ["--trainer.plugins", "lit_minimind.model.precision.CPUFloat16Mixed"])],
             jobs=2, child_timeout_s=600.0, deadline_s=1800.0)
DEADLINE = {"at": float("inf"), "child_s": 600.0}


def child_timeout() -> float:
    """Seconds the next child may run: the per-child limit, or what is left of the overall deadline."""
    left = DEADLINE["at"] - time.monotonic()
    if left < 5:
        raise RuntimeError("not run: the benchmark's overall deadline was reached")
    return min(DEADLINE["child_s"], left)


def peak_flops(device: str, override_tflops: float | None = None) -> float | None:
    known = next((f for key, f in PEAK_BF16_FLOPS if key.lower() in device.lower()), None)
    return override_tflops * 1e12 if override_tflops else known


def bitwise_equal(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        raw = lambda t: t.reshape(-1).contiguous().view(torch.uint8)
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(raw(a), raw(b)))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(bitwise_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(bitwise_equal(x, y) for x, y in zip(a, b))
    return a == b


def compare_runs(a: dict[str, Any], b: dict[str, Any], stem: str) -> dict[str, Any]:
    """Export, resume checkpoint (``state_dict``, optimizer, GradScaler, data position, global step) and the console
    lines both printed of two runs; a run killed and resumed (``killed``): where it was killed and resumed."""
    import torch

    load = lambda r, name: torch.load(r["dir"] / name, map_location="cpu", weights_only=True)
    (ea, ra), (eb, rb) = ((load(r, f"out/{stem}.pth"), load(r, f"checkpoints/{stem}_resume.pth")) for r in (a, b))
    sa, sb, common = ra["state_dict"], rb["state_dict"], sorted(set(a["lines"]) & set(b["lines"]))
    diffs = [float((x.float() - sb[k].float()).abs().max()) for k, x in sa.items()
             if x.is_floating_point() and x.numel() and k in sb and x.shape == sb[k].shape]
    out = {"export_equal": bitwise_equal(ea, eb), "state_dict_equal": bitwise_equal(sa, sb),
           **{f"{name}_equal": bitwise_equal(ra.get(key), rb.get(key)) for name, key in (
               ("optimizer", "optimizer_states"), ("scaler", "scaler"), ("data_position", "MiniMindDataModule"))},
           "global_step": [ra.get("global_step"), rb.get("global_step")],
           "state_dict_max_abs_diff": max(diffs, default=None), "console_lines_compared": len(common),
           "console_lines_equal": all(a["lines"][k] == b["lines"][k] for k in common), "tensors": len(sa)}
    out["identical"] = all(out[k] for k in out if k.endswith("_equal")) and len(common) > 0 \
        and out["global_step"][0] == out["global_step"][1]
    if "killed" in b:
        m = re.search(r"_s(\d+)_g(\d+)", bc.event(b["killed"], "committed")["path"])
        steps = {run: [int(key.split(":")[1]) for key in b[run]["lines"]] for run in ("killed", "resumed")}
        out.update(killed_after_save_at_step=int(m[2]) if m else None,
                   killed_at_last_console_step=max(steps["killed"], default=0),
                   resumed_first_console_step=min(steps["resumed"], default=None))
    return out


def throughput_phase(cfg: Config, data: Path, tok: Path, reps: int, peak: float | None) -> dict[str, Any]:
    runs = compare(cfg, ["plain", "port", "port_nondeterministic"], data, tok, reps, warmup=False,
                   label="a: throughput", timeout=child_timeout)
    params, sides = runs["port"][0]["params"], {}
    for side, rs in runs.items():
        tps = bc.stats(rs, "tokens_per_s")
        sides[side] = {"tokens_per_s": tps, "ms_per_batch": 1000 * cfg.tokens_per_batch / tps["median"],
                       "mfu": 6 * params * tps["median"] / peak if peak else None,
                       "last_loss": [r["last_loss"] for r in rs], "deterministic": rs[0]["deterministic"],
                       "peak_memory_bytes": max(r["peak_memory_bytes"] or 0 for r in rs) or None}
    return {"config": asdict(cfg), "params": params, "device": runs["port"][0]["device"], "peak_bf16_flops": peak,
            "sides": sides, "port_over_plain": bc.ratios(runs["port"], runs["plain"], "tokens_per_s"),
            "nondeterministic_over_default": bc.ratios(runs["port_nondeterministic"], runs["port"], "tokens_per_s"),
            "last_loss_diff_port_plain": max(abs(p["last_loss"] - q["last_loss"])
                                             for p, q in zip(runs["port"], runs["plain"]))}


def exactness_phase(spec: Spec, data: Path, tok: Path, work: Path) -> dict[str, Any]:
    """The :data:`RUNS` of (b)-(d), ``spec.jobs`` at once; a failed or timed-out one (the deadline included) is
    reported as ``error``."""
    from lit_minimind.checkpoint.names import checkpoint_stem

    cfg, stem = spec.cfg, checkpoint_stem("pretrain", spec.cfg.hidden_size, False)
    (main_label, main), (fp16_label, fp16) = spec.precisions
    flags = {"model.learning_rate": cfg.learning_rate, "data.num_workers": cfg.num_workers,
             "trainer.accelerator": cfg.accelerator, "trainer.max_steps": spec.resume_steps,
             "log_interval": spec.resume_log_interval, "resume.save_interval": spec.save_interval}

    def cli(name: str, *extra: str, kill: bool = False) -> dict[str, Any]:
        probe = bc.probe(warmup=cfg.warmup_batches, sync_every=spec.save_interval, kill_after_commit=kill)
        precision = fp16 if name.startswith("fp16") else main
        cmd = bc.fit_cmd(work / name, data, tok, cfg.shape, flags, *precision, *extra, *probe)
        run = bc.launch(cmd, work / name, timeout=child_timeout(), check=not kill)
        if kill and not (bc.event(run, "committed") and run["returncode"] == -9):
            raise RuntimeError(f"the run was to kill itself after its first save (exit {run['returncode']}):\n"
                               + bc.tail(run["lines"], 20))
        return {**run, "dir": work / name, "lines": bc.console(run), "probe": bc.event(run, "end")}

    def task(name: str) -> dict[str, Any]:
        """One run; ``*_kill``: one killed after its first save, then resumed with ``--ckpt_path last``."""
        try:
            if not name.endswith("_kill"):
                return cli(name, *(["--resume.async_save", "false"] if name == "main_sync_save" else []))
            killed, resumed = cli(name, kill=True), cli(name, "--ckpt_path", "last")
        except RuntimeError as err:
            return {"error": str(err).splitlines()[0][:500], "wall_s": 0.0}
        lines = dict(killed["lines"])  # steps trained again after the resume must print the same line
        for key, value in resumed["lines"].items():
            lines[key] = value if lines.get(key, value) == value else ["differs between the killed and the resumed run"]
        return {"dir": work / name, "killed": killed, "resumed": resumed, "lines": lines,
                "wall_s": killed["wall_s"] + resumed["wall_s"]}

    with ThreadPoolExecutor(max_workers=spec.jobs) as pool:
        done = dict(zip(RUNS, pool.map(task, RUNS)))
    for name, r in done.items():
        bc.say(f"  [b-d: exactness, stall] {name}: "
               + (f"FAILED: {r['error']}" if "error" in r else f"done in {r['wall_s']:.0f} s"))

    def compared(ref: str, other: str) -> dict[str, Any]:
        if errors := [f"{n}: {done[n]['error']}" for n in (ref, other) if "error" in done[n]]:
            return {"identical": False, "error": "; ".join(errors)}
        return compare_runs(done[ref], done[other], stem)

    ckpts = sorted((work / "main" / "checkpoints").glob(f"{stem}_e*.ckpt"))
    export = work / "main" / "out" / f"{stem}.pth"
    ok = [n for n in ("main", "main_again", "main_sync_save") if "error" not in done[n]]
    return {"stem": stem, "steps": spec.resume_steps, "save_interval": spec.save_interval,
            "resume": {main_label: compared("main", "main_kill"), fp16_label: compared("fp16", "fp16_kill")},
            "determinism": {"two_uninterrupted_runs": compared("main", "main_again"),
                            "async_vs_sync_save": compared("main", "main_sync_save"),
                            "deterministic_flags": {k: done["main"]["probe"][k] for k in (
                                "deterministic", "deterministic_warn_only")} if "main" in ok else None},
            "stall": {"runs": {n: done[n]["probe"] for n in ok},
                      "checkpoint_bytes": ckpts[-1].stat().st_size if ckpts else None,
                      "export_bytes": export.stat().st_size if export.exists() else None}}


def stall_summary(stall: dict[str, Any], base_s: float, warmup: int, save_interval: int) -> dict[str, Any]:
    """Per save mode: the loop held in each save inside the timed window, the window's excess over no-save batches."""
    out: dict[str, Any] = {}
    for mode, names in (("async", ("main", "main_again")), ("sync", ("main_sync_save",))):
        held, excess = [], []
        for p in (stall["runs"][n] for n in names if n in stall["runs"]):
            window = len(p["ends"]) - warmup
            inside = [s["s"] for s in p["saves"] if warmup < s["batch"] < len(p["ends"])]  # the last: after the window
            held += inside
            if inside:
                excess.append((p["ends"][-1][0] - p["ends"][warmup - 1][0] - window * base_s) / len(inside))
        if held:
            out[mode] = {"saves": len(held), "held_s": bc.stats(held), "window_excess_per_save_s": bc.stats(excess),
                         "slowdown_at_interval": bc.stats(held)["median"] / (save_interval * base_s)}
    return out


def render(payload: dict[str, Any]) -> str:
    a, ex, yes = payload["throughput"], payload["exactness"], lambda b: "**yes**" if b else "**NO**"
    out = [f"not run or failed: {e}" for e in payload["errors"]]
    if a is not None:
        labels = {"plain": "plain PyTorch loop (deterministic, as the port's default)",
                  "port": "port: python -m lit_minimind.fit (default --trainer.deterministic true)",
                  "port_nondeterministic": "port, --trainer.deterministic false"}
        vs = {"plain": 1.0, "port": a["port_over_plain"]["median"],
              "port_nondeterministic": a["port_over_plain"]["median"] * a["nondeterministic_over_default"]["median"]}
        rows = [[labels[side], bc.spread(r["tokens_per_s"], fmt=bc.fmt_num), f"{r['ms_per_batch']:.1f}",
                 "–" if r["mfu"] is None else f"{100 * r['mfu']:.1f} %", f"{vs[side]:.3f}",
                 f"{r['peak_memory_bytes'] / 2**30:.1f}" if r["peak_memory_bytes"] else "–"]
                for side, r in a["sides"].items()]
        peak = f"{a['peak_bf16_flops'] / 1e12:.0f} TFLOPS" if a["peak_bf16_flops"] else "unknown: no MFU"
        out += [f"(a) throughput, {a['config']['name']}, {a['params'] / 1e6:.1f}M params, batch "
                f"{a['config']['batch_size']}x{a['config']['max_seq_len']}, on {a['device']} (dense bf16 peak {peak})",
                bc.table(["side", "tok/s med (min–max)", "ms / micro-batch", "MFU (6N)", "÷ plain", "peak GPU GiB"],
                         rows), f"Δ last loss port vs plain {a['last_loss_diff_port_plain']:.1e}", ""]
    checks = [(f"(b) kill + resume --ckpt_path last, {label}", r) for label, r in ex["resume"].items()]
    checks += [("(c) two uninterrupted runs, default deterministic", ex["determinism"]["two_uninterrupted_runs"]),
               ("(c) async vs --resume.async_save false", ex["determinism"]["async_vs_sync_save"])]
    rows = []
    for text, r in checks:
        killed = (f"SIGKILL after the save at step {r['killed_after_save_at_step']} (console at step "
                  f"{r['killed_at_last_console_step']}); ") if "killed_after_save_at_step" in r else ""
        detail = r.get("error", "")[:200] or (
            f"{killed}export {yes(r['export_equal'])}, state_dict {yes(r['state_dict_equal'])}, optimizer "
            f"{yes(r['optimizer_equal'])}, scaler {yes(r['scaler_equal'])}, {r['console_lines_compared']} console "
            f"lines equal {yes(r['console_lines_equal'])}, max |Δ| {r['state_dict_max_abs_diff']}")
        rows.append([text, yes(r["identical"]), detail])
    out += [f"(b)/(c) bit-for-bit checks ({ex['steps']} steps, a save every {ex['save_interval']}):",
            bc.table(["check", "identical", "detail"], rows), ""]
    rows = [[mode, s["saves"], bc.spread(s["held_s"]), f"{s['window_excess_per_save_s']['median']:.3f}",
             f"{100 * s['slowdown_at_interval']:.2f} %"] for mode, s in (payload["save_stall"] or {}).items()]
    if rows:
        mib = lambda key: (ex["stall"][key] or 0) / 2**20
        out += [f"(d) save stall at --resume.save_interval {ex['save_interval']} (checkpoint "
                f"{mib('checkpoint_bytes'):.0f} MiB + export {mib('export_bytes'):.0f} MiB; no-save step "
                f"{payload['base_ms_per_batch']:.1f} ms):",
                bc.table(["save", "saves timed", "loop held per save s med (min–max)", "window excess per save s",
                          f"held ÷ {ex['save_interval']} steps"], rows)]
    return "\n".join(out)


def run(quick: bool = False, reps: int | None = None, peak_tflops: float | None = None) -> dict[str, Any]:
    import torch

    if not (cuda := torch.cuda.is_available()) and not quick:
        raise bc.BenchError(NO_GPU)
    spec, start = QUICK if quick else GPU, time.perf_counter()
    reps = reps or spec.reps
    DEADLINE.update(at=time.monotonic() + spec.deadline_s, child_s=spec.child_timeout_s)
    _, tok = bc.default_data()
    data = bc.synthetic_jsonl(spec.lines, 2400, 3000, seed=7)
    device = torch.cuda.get_device_name() if cuda and not quick else "CPU (--quick)"
    bc.say(f"  {spec.cfg.name} on {device}" + (" (--quick: CPU smoke test, not GPU results)" if quick else ""))
    a, errors = None, []
    with bc.workdir("gpu") as work:
        try:
            a = throughput_phase(spec.cfg, data, tok, reps, None if quick else peak_flops(device, peak_tflops))
        except (RuntimeError, AssertionError) as err:  # a failed or timed-out child: (b)-(d) still run
            errors.append(f"(a) throughput: {str(err).splitlines()[0][:500]}")
        ex = exactness_phase(spec, data, tok, work)
    base = a["sides"]["port"]["ms_per_batch"] / 1000 if a is not None else None
    checks = [*ex["resume"].values(), *(ex["determinism"][k] for k in ("two_uninterrupted_runs", "async_vs_sync_save"))]
    identical = not errors and all(r["identical"] for r in checks)
    payload = {"results_file": "gpu_quick" if quick else "gpu", "gpu_results": not quick, "reps": reps,
               "cuda": torch.version.cuda, "device": device, "data": bc.rel(data), "tokenizer": bc.rel(tok),
               "spec": asdict(spec), "throughput": a, "exactness": ex,
               "base_ms_per_batch": 1000 * base if base else None,
               "save_stall": base and stall_summary(ex["stall"], base, spec.cfg.warmup_batches, spec.save_interval),
               "wall_s": time.perf_counter() - start, "errors": errors, "all_identical": identical,
               "exit_status": 0 if identical else 1}
    payload["table"] = render(payload)
    payload["verdict"] = (f"{'quick CPU smoke test' if quick else 'GPU benchmark'}: {payload['wall_s']:.0f} s; every "
                          f"bit-for-bit check {'passed' if identical else 'did NOT pass'}")
    return payload


if __name__ == "__main__":
    from benchmarks.run_all import main
    raise SystemExit(main(alone=NAME))
