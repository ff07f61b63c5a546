"""Resume cost vs position: process start -> first trained batch, resuming early or late in an epoch.

A 1M-line pretrain jsonl of short texts is generated once into the cache dir. For each
position ``K`` (batches already trained in epoch 1) a MiniMind-format resume checkpoint is
written with :func:`lit_minimind.resume.library.save_resume_checkpoint` from a small model whose
optimizer has taken one step, and the real CLI (``lit_minimind.fit.main``, through
:mod:`benchmarks._fit_probe`, which only adds timestamps) is started in a subprocess with
``--ckpt_path <file> --log_interval 1``. The time is measured from just before the process is
launched to the moment its first MiniMind console line (``Epoch:[1/1](K+1/N), ...``, printed
after the first trained batch) is read; then the process is killed. The probe also reports
how many samples were read before that batch (must be one batch: skipped batches are never
read, tokenized or collated) and when the jsonl scan, the checkpoint read and the epoch
permutation ran. Positions run in rotated order in every repetition; ``fresh`` is a run
without any checkpoint, for reference.

``python -m benchmarks.bench_resume [--quick] [--reps N]``
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
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
    pyplot,
    rel,
    save_figure,
    say,
    set_threads,
    stats,
    synthetic_jsonl,
    table,
    write_json,
)

TARGET_RATIO = 1.1
FULL = {"lines": 1_000_000, "positions": ["fresh", 0, 10_000, 100_000], "reps": 5, "warmup": True}
QUICK = {"lines": 20_000, "positions": [0, 100, 1_000], "reps": 1, "warmup": False}
MODEL = {"hidden_size": 64, "num_hidden_layers": 2}
MAX_SEQ_LEN, BATCH_SIZE = 64, 4
PHASES = [  # (label, start event, end event)
    ("python + imports", "launch", "imported"),
    ("jsonl scan", "scan_start", "scan_end"),
    ("checkpoint read", "ckpt_read_start", "ckpt_read_end"),
    ("epoch permutation", "permutation_start", "permutation_end"),
    ("first batch (read, step)", "first_sample", "first_batch_end"),
]

_WORDS = ("the of and to in a is that for it as was with be by on not he this are or his from at which but have "
          "an they you were her she there been one all we their has would when if so no out up into do any your "
          "what more than them some time could only other new these two may first then model token train data "
          "loss step epoch batch mind small large learn read write").split()


# --------------------------------------------------------------------------- inputs


def generate_jsonl(lines: int) -> Path:
    """A pretrain jsonl of ``lines`` short texts (40-110 characters), generated once, deterministically."""
    return synthetic_jsonl(lines, 40, 110)


def make_checkpoint(directory: Path, step: int) -> Path:
    """A MiniMind-format resume checkpoint at batch ``step`` of epoch 0 (model + AdamW after one step)."""
    import torch

    from lit_minimind.model import MiniMindConfig, MiniMindForCausalLM
    from lit_minimind.resume.library import save_resume_checkpoint

    torch.manual_seed(0)
    model = MiniMindForCausalLM(MiniMindConfig(**MODEL))
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-4, weight_decay=0.01)
    x = torch.randint(3, 6400, (2, 16))
    model(x, labels=x).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    _, resume = save_resume_checkpoint(model, optimizer, save_dir=directory, weight="pretrain",
                                       hidden_size=MODEL["hidden_size"], use_moe=False, epoch=0, step=step)
    return resume


# --------------------------------------------------------------------------- one run


def cli_args(data: Path, tok: Path, work: Path, position: int | str, ckpt: Path | None) -> list[str]:
    step = 0 if position == "fresh" else int(position)
    args = [
        "--model.hidden_size", str(MODEL["hidden_size"]), "--model.num_hidden_layers", str(MODEL["num_hidden_layers"]),
        "--data.data_path", str(data), "--data.tokenizer_path", str(tok),
        "--data.max_seq_len", str(MAX_SEQ_LEN), "--data.batch_size", str(BATCH_SIZE),
        # max_steps is only a safety net: the process is killed at its first console line
        "--trainer.max_epochs", "1", "--trainer.max_steps", str(step + 2),
        "--trainer.accelerator", "cpu", "--trainer.devices", "1",
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
        "--log_interval", "1", "--resume.save_interval", str(10**9),
        "--resume.out_dir", str(work / "out"), "--resume.ckpt_dir", str(work / "checkpoints"),
    ]
    return args + (["--ckpt_path", str(ckpt)] if ckpt is not None else [])


def run_once(args: list[str], work: Path, timeout: float = 600) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIT_MINIMIND_TEST")}
    env.update({"PYTHONPATH": str(ROOT), "LIT_MINIMIND_CACHE": str(cache_dir()), "PYTHONUNBUFFERED": "1",
                "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled"})
    events: dict[str, float] = {}
    info: dict[str, Any] = {}
    tail: list[str] = []
    launch = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks._fit_probe", *args], cwd=work, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    watchdog = threading.Timer(timeout, lambda: os.killpg(proc.pid, signal.SIGKILL))
    watchdog.start()
    first_line = None
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("@@bench "):
                _, event, stamp, *extra = line.split()
                events.setdefault(event, float(stamp))
                for item in extra:
                    key, _, value = item.partition("=")
                    info[key] = int(value)
                continue
            tail = (tail + [line])[-40:]
            m = CONSOLE_LINE_RE.search(line)
            if m:
                first_line = time.monotonic()
                info.update(epoch=int(m[1]), step=int(m[3]), iters=int(m[4]))
                break
    finally:
        watchdog.cancel()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        # reap it ourselves to get its CPU time (user + system) up to the kill, a few ms after the line
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        cpu = usage.ru_utime + usage.ru_stime
    if first_line is None:
        raise RuntimeError(f"the CLI printed no console line (exit {proc.returncode}):\n{''.join(tail)}")
    events["launch"] = launch
    total = first_line - launch
    phases = {label: events[b] - events[a] if a in events and b in events else 0.0 for label, a, b in PHASES}
    phases["other (CLI, Trainer, restore)"] = total - sum(phases.values())
    return {"total_s": total, "cpu_s": cpu, "phases": phases, **info}


# --------------------------------------------------------------------------- benchmark


def run(quick: bool = False, results_dir: Path = RESULTS_DIR, reps: int | None = None,
        threads: int | None = None) -> dict[str, Any]:
    threads = set_threads(threads)  # exported to the CLI processes as OMP_NUM_THREADS
    spec = QUICK if quick else FULL
    reps = reps or spec["reps"]
    positions: list[int | str] = list(spec["positions"])
    _, tok = default_data()
    t = time.perf_counter()
    data = generate_jsonl(spec["lines"])
    say(f"== resume cost vs position ({spec['lines']:,}-line jsonl {data.name}, ready in "
        f"{time.perf_counter() - t:.1f}s; {reps} rotated repetitions, {threads} torch thread(s)) ==")
    iters = -(-spec["lines"] // BATCH_SIZE)
    work = Path(tempfile.mkdtemp(prefix="bench-resume-", dir=cache_dir()))
    try:
        ckpts = {p: (make_checkpoint(work / f"ckpt_{p}", int(p)) if p != "fresh" else None) for p in positions}
        if spec["warmup"]:
            say("  warm-up run (page cache, first imports) ...")
            run_once(cli_args(data, tok, work, positions[-1], ckpts[positions[-1]]), work)
        runs: dict[Any, list[dict[str, Any]]] = {p: [] for p in positions}
        for rep in range(reps):
            for p in alternating(positions, rep):
                r = run_once(cli_args(data, tok, work, p, ckpts[p]), work)
                expected = (0 if p == "fresh" else int(p)) + 1
                if (r.get("step"), r.get("iters")) != (expected, iters):
                    raise RuntimeError(f"position {p}: first line is step {r.get('step')}/{r.get('iters')}, "
                                       f"expected {expected}/{iters}")
                runs[p].append(r)
                say(f"  rep {rep + 1}/{reps} position {p}: {r['total_s']:.2f}s to batch {r['step']}/{r['iters']}, "
                    f"{r.get('samples')} samples read")
    finally:
        shutil.rmtree(work, ignore_errors=True)

    numeric = [p for p in positions if p != "fresh"]
    first, last = numeric[0], numeric[-1]
    rows, results = [], []
    for p in positions:
        total = stats([r["total_s"] for r in runs[p]])
        cpu = stats([r["cpu_s"] for r in runs[p]])
        phases = {k: stats([r["phases"][k] for r in runs[p]])["median"] for k in runs[p][0]["phases"]}
        # ratios within a repetition (same machine load), then their median
        ratio = stats([b["total_s"] / a["total_s"] for a, b in zip(runs[first], runs[p])])
        cpu_ratio = stats([b["cpu_s"] / a["cpu_s"] for a, b in zip(runs[first], runs[p])])
        results.append({"position": p, "first_step": runs[p][0]["step"], "iters": iters,
                        "samples_read_before_first_batch": max(r.get("samples", -1) for r in runs[p]),
                        "total_s": total, "cpu_s": cpu, "phases_median_s": phases,
                        "ratio_vs_first": ratio, "cpu_ratio_vs_first": cpu_ratio})
        rows.append([
            p if p == "fresh" else f"{int(p):,}", f"{runs[p][0]['step']:,}/{iters:,}",
            results[-1]["samples_read_before_first_batch"],
            f"{total['median']:.2f} ({total['min']:.2f}–{total['max']:.2f})",
            *(f"{v:.2f}" for v in phases.values()),
            f"{cpu['median']:.2f}",
            f"{ratio['median']:.3f} ({ratio['min']:.3f}–{ratio['max']:.3f})",
            f"{cpu_ratio['median']:.3f}",
        ])
    ratio = results[positions.index(last)]["ratio_vs_first"]
    text = table(["resume at step", "first batch", "samples read", "launch→1st batch s med (min–max)",
                  *[k for k in runs[positions[0]][0]["phases"]], "CPU s med",
                  f"÷ step {first} med (min–max)", f"CPU ÷ step {first}"], rows)
    cpu_ratio = results[positions.index(last)]["cpu_ratio_vs_first"]
    verdict = (f"step {last:,} / step {first}, launch → first trained batch: **{ratio['median']:.3f}** (median of "
               f"per-repetition ratios, min {ratio['min']:.3f}, max {ratio['max']:.3f}); target ≤ {TARGET_RATIO}: "
               f"{'yes' if ratio['median'] <= TARGET_RATIO else 'NO'}. CPU time of the process: "
               f"{cpu_ratio['median']:.3f} ({cpu_ratio['min']:.3f}–{cpu_ratio['max']:.3f}).")
    say(text)
    say(verdict)
    payload = {"benchmark": "resume", "quick": quick, "reps": reps, "threads": threads, "environment": environment(),
               "lines": spec["lines"], "data": rel(data), "data_bytes": data.stat().st_size, "batch_size": BATCH_SIZE,
               "max_seq_len": MAX_SEQ_LEN, "model": MODEL, "results": results,
               "ratio_last_vs_first": ratio, "cpu_ratio_last_vs_first": cpu_ratio, "target_ratio": TARGET_RATIO, "target_met": ratio["median"] <= TARGET_RATIO,
               "table": text, "verdict": verdict, "runs": {str(k): v for k, v in runs.items()}}
    write_json(results_dir / "resume.json", payload)
    plot(results, results_dir / "resume.png")
    return payload


def plot(results: list[dict[str, Any]], path: Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 3.4))
    labels = [str(r["position"]) if r["position"] == "fresh" else f"{int(r['position']):,}" for r in results]
    bottom = [0.0] * len(results)
    for phase in results[0]["phases_median_s"]:
        vals = [r["phases_median_s"][phase] for r in results]
        ax.bar(labels, vals, 0.6, bottom=bottom, label=phase)
        bottom = [b + v for b, v in zip(bottom, vals)]
    for i, r in enumerate(results):
        t = r["total_s"]
        ax.errorbar(i, t["median"], yerr=[[t["median"] - t["min"]], [t["max"] - t["median"]]], color="black", capsize=3)
    ax.set_xlabel("resume at step (batches already trained in the epoch)")
    ax.set_ylabel("launch → first trained batch, s")
    ax.set_title("resume cost vs position (median phases, min–max total)")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, "rotated repetitions (default 5, quick 1)")
    args = parser.parse_args(argv)
    run(args.quick, args.results_dir, args.reps, args.threads)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
