"""Resume cost vs position: launch -> first trained batch of python -m lit_minimind.fit, resuming early or late in an epoch.

For each position ``K`` in a 1M-line jsonl a MiniMind resume checkpoint is written
(:func:`lit_minimind.resume.library.save_resume_checkpoint`) and the CLI started with ``--ckpt_path <file>`` and
``Probe(count_reads=True)``; killed at its first console line. The phases are cut at the probe's hook events;
``samples read``: dataset reads before the first batch (one batch: skipped batches are never read). Positions rotate
every repetition; ``fresh`` (no checkpoint) is for reference.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import common as bc

NAME = "resume"
TARGET_RATIO = 1.1
FULL = {"lines": 1_000_000, "positions": ["fresh", 0, 10_000, 100_000], "reps": 5, "warmup": True}
QUICK = {"lines": 20_000, "positions": [0, 100, 1_000], "reps": 1, "warmup": False}
MODEL, MAX_SEQ_LEN, BATCH_SIZE = {"hidden_size": 64, "num_hidden_layers": 2}, 64, 4
PHASES = [("python, imports, CLI parsing", "init"), ("model, Trainer, checkpoint read, data index", "setup"),
          ("Lightning restore, fit start", "train_start"), ("epoch start, first batch read", "batch_start"),
          ("first step", "batch_end")]


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
    return save_resume_checkpoint(model, optimizer, save_dir=directory, weight="pretrain", hidden_size=MODEL["hidden_size"],
                                  use_moe=False, epoch=0, step=step)[1]


def run_once(data: Path, tok: Path, work: Path, position: int | str, ckpt: Path | None) -> dict[str, Any]:
    step = 0 if position == "fresh" else int(position)
    flags = {"model.hidden_size": MODEL["hidden_size"], "model.num_hidden_layers": MODEL["num_hidden_layers"],
             "data.max_seq_len": MAX_SEQ_LEN, "data.batch_size": BATCH_SIZE, "trainer.max_steps": step + 2, "log_interval": 1}
    cmd = bc.fit_cmd(work, data, tok, flags, *bc.probe(count_reads=True), *(["--ckpt_path", str(ckpt)] if ckpt else []))
    run = bc.launch(cmd, work, until=bc.CONSOLE_LINE_RE.search)  # printed after the probe's batch_end
    first = next(((t, m) for t, line in run["lines"] if (m := bc.CONSOLE_LINE_RE.search(line))), None)
    if first is None or not run["stopped"]:
        raise RuntimeError("the CLI printed no console line:\n" + "".join(line for _, line in run["lines"][-30:]))
    total, start, phases = first[0], 0.0, {}
    for label, name in PHASES:
        at = bc.event(run, name)["t"]
        phases[label], start = at - start, at
    phases["first step"] += total - start  # to the console line
    return {"total_s": total, "cpu_s": run["cpu_s"], "phases": phases, "samples": bc.event(run, "batch_start")["reads"],
            "epoch": int(first[1][1]), "step": int(first[1][3]), "iters": int(first[1][4])}


def run(quick: bool = False, reps: int | None = None) -> dict[str, Any]:
    spec = QUICK if quick else FULL
    reps, positions = reps or spec["reps"], list(spec["positions"])
    _, tok = bc.default_data()
    data = bc.synthetic_jsonl(spec["lines"], 40, 110)
    iters = -(-spec["lines"] // BATCH_SIZE)
    work = Path(tempfile.mkdtemp(prefix="bench-resume-", dir=bc.cache_dir()))
    try:
        ckpts = {p: (make_checkpoint(work / f"ckpt_{p}", int(p)) if p != "fresh" else None) for p in positions}
        if spec["warmup"]:
            bc.say("  warm-up run (page cache, first imports) ...")
            run_once(data, tok, work, positions[-1], ckpts[positions[-1]])
        runs: dict[Any, list[dict[str, Any]]] = {p: [] for p in positions}
        for rep in range(reps):
            for p in bc.alternating(positions, rep):
                r = run_once(data, tok, work, p, ckpts[p])
                if (r["step"], r["iters"]) != ((0 if p == "fresh" else int(p)) + 1, iters):
                    raise RuntimeError(f"position {p}: the first line is step {r['step']}/{r['iters']}")
                runs[p].append(r)
                bc.say(f"  rep {rep + 1}/{reps} position {p}: {r['total_s']:.2f}s to batch {r['step']}/{r['iters']}, {r['samples']} samples read")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    numeric = [p for p in positions if p != "fresh"]
    first, last = numeric[0], numeric[-1]
    results, rows = [], []
    for p in positions:
        total, cpu = bc.stats([r["total_s"] for r in runs[p]]), bc.stats([r["cpu_s"] for r in runs[p]])
        phases = {k: bc.stats([r["phases"][k] for r in runs[p]])["median"] for k in runs[p][0]["phases"]}
        vs = bc.stats([b["total_s"] / a["total_s"] for a, b in zip(runs[first], runs[p])])  # within a repetition
        cpu_vs = bc.stats([b["cpu_s"] / a["cpu_s"] for a, b in zip(runs[first], runs[p])])
        results.append({"position": p, "first_step": runs[p][0]["step"], "iters": iters, "total_s": total, "cpu_s": cpu,
                        "samples_read_before_first_batch": max(r["samples"] for r in runs[p]), "phases_median_s": phases,
                        "ratio_vs_first": vs, "cpu_ratio_vs_first": cpu_vs})
        rows.append([p if p == "fresh" else f"{int(p):,}", f"{runs[p][0]['step']:,}/{iters:,}", results[-1]["samples_read_before_first_batch"],
                     bc.spread(total, 2), *(f"{v:.2f}" for v in phases.values()), f"{cpu['median']:.2f}", bc.spread(vs), f"{cpu_vs['median']:.3f}"])
    ratio, cpu_ratio = results[positions.index(last)]["ratio_vs_first"], results[positions.index(last)]["cpu_ratio_vs_first"]
    text = bc.table(["resume at step", "first batch", "samples read", "launch→1st batch s med (min–max)", *[k for k, _ in PHASES],
                  "CPU s med", f"÷ step {first} med (min–max)", f"CPU ÷ step {first}"], rows)
    verdict = (f"step {last:,} / step {first}, launch → first trained batch: **{ratio['median']:.3f}** (median of per-repetition "
               f"ratios, min {ratio['min']:.3f}, max {ratio['max']:.3f}); target ≤ {TARGET_RATIO}: "
               f"{'yes' if ratio['median'] <= TARGET_RATIO else 'NO'}. CPU time of the process: {bc.spread(cpu_ratio)}.")
    return {"reps": reps, "lines": spec["lines"], "data": bc.rel(data), "data_bytes": data.stat().st_size, "batch_size": BATCH_SIZE,
            "max_seq_len": MAX_SEQ_LEN, "model": MODEL, "results": results, "ratio_last_vs_first": ratio,
            "cpu_ratio_last_vs_first": cpu_ratio, "target_ratio": TARGET_RATIO, "target_met": ratio["median"] <= TARGET_RATIO,
            "table": text, "verdict": verdict, "runs": {str(k): v for k, v in runs.items()}}


def plot(p: dict[str, Any], path: Path) -> Path:
    plt, results = bc.pyplot(), p["results"]
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
    ax.set(xlabel="resume at step (batches already trained in the epoch)", ylabel="launch → first trained batch, s",
           title="resume cost vs position (median phases, min–max total)")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return bc.save_figure(fig, path)


if __name__ == "__main__":
    raise SystemExit(bc.bench_main(sys.modules[__name__]))
