"""Resume cost vs position: launch -> first trained batch of the CLI, resuming early or late in an epoch.

Per position ``K`` of a 1M-line jsonl (batch 4, seq 64, a 64x2 model) a MiniMind resume checkpoint at step ``K``
(``save_resume_checkpoint``), then ``python -m lit_minimind.fit --ckpt_path <file>`` with ``Probe(count_reads=True)``,
killed at its first console line; phases (medians) cut at the probe's hook events; samples read before the first batch
(one batch: skipped ones are never read). The data index is built once beforehand, in a plain process; positions
rotate after a warm-up run; ``fresh``: no checkpoint. Target: the last ÷ the first position <= 1.1.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from benchmarks import common as bc

NAME = "resume"
TARGET_RATIO = 1.1
FULL = {"lines": 1_000_000, "positions": ["fresh", 0, 10_000, 100_000], "reps": 5, "warmup": True}
QUICK = {"lines": 20_000, "positions": [0, 100, 1_000], "reps": 1, "warmup": False}
MODEL, MAX_SEQ_LEN, BATCH_SIZE = {"hidden_size": 64, "num_hidden_layers": 2}, 64, 4
# the data index built in a plain process, as the warm-up run would: the CLI's own first scan of a file over 64 MiB
# hangs (its forked scan workers inherit the CLI's SIGTERM handler, so the pool's terminate() never ends them)
INDEX = ("import sys; from lit_minimind.data.datamodule import MiniMindDataModule as M; "
         "M(data_path=sys.argv[1], tokenizer_path=sys.argv[2]).setup('fit')")
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
    return save_resume_checkpoint(model, optimizer, save_dir=directory, weight="pretrain",
                                  hidden_size=MODEL["hidden_size"], use_moe=False, epoch=0, step=step)[1]


def run_once(data: Path, tok: Path, work: Path, step: int, ckpt: Path | None, iters: int) -> dict[str, Any]:
    flags = {"trainer.max_steps": step + 2, "log_interval": 1}
    cmd = bc.fit_cmd(work, data, tok, (*MODEL.values(), MAX_SEQ_LEN, BATCH_SIZE), flags, *bc.probe(count_reads=True),
                     *(["--ckpt_path", str(ckpt)] if ckpt else []))
    run = bc.launch(cmd, work, until=bc.CONSOLE_LINE_RE.search)  # printed after the probe's batch_end
    if not run["stopped"]:
        raise RuntimeError("the CLI printed no console line:\n" + bc.tail(run["lines"]))
    total, line = run["lines"][-1]  # the console line it was stopped at
    m, start, phases = bc.CONSOLE_LINE_RE.search(line), 0.0, {}
    if (int(m[3]), int(m[4])) != (step + 1, iters):
        raise RuntimeError(f"resuming at step {step}: the first line is step {m[3]}/{m[4]}")
    for label, name in PHASES:
        at = bc.event(run, name)["t"]
        phases[label], start = at - start, at
    phases["first step"] += total - start  # to the console line
    return {"total_s": total, "cpu_s": run["cpu_s"], "phases": phases, "samples": bc.event(run, "batch_start")["reads"],
            "step": int(m[3])}


def run(quick: bool = False, reps: int | None = None) -> dict[str, Any]:
    spec = QUICK if quick else FULL
    reps, positions = reps or spec["reps"], list(spec["positions"])
    step = {p: 0 if p == "fresh" else int(p) for p in positions}
    _, tok = bc.default_data()
    data = bc.synthetic_jsonl(spec["lines"], 40, 110)
    iters = -(-spec["lines"] // BATCH_SIZE)
    with bc.workdir("resume") as work:
        ckpts = {p: make_checkpoint(work / f"ckpt_{p}", step[p]) if p != "fresh" else None for p in positions}
        bc.launch([sys.executable, "-c", INDEX, str(data), str(tok)], work)
        runs = bc.rotated(positions, reps, lambda p: run_once(data, tok, work, step[p], ckpts[p], iters),
                          warmup=positions[-1:] if spec["warmup"] else (),  # the page cache, first imports
                          note=lambda r: f"{r['total_s']:.2f} s to step {r['step']}, {r['samples']} samples read")
    numeric = [p for p in positions if p != "fresh"]
    first, last = numeric[0], numeric[-1]
    results, rows = [], []
    for p in positions:
        total, cpu = bc.stats(runs[p], "total_s"), bc.stats(runs[p], "cpu_s")
        phases = {k: bc.stats([r["phases"][k] for r in runs[p]])["median"] for k in runs[p][0]["phases"]}
        vs, cpu_vs = bc.ratios(runs[p], runs[first], "total_s"), bc.ratios(runs[p], runs[first], "cpu_s")
        samples = max(r["samples"] for r in runs[p])
        results.append({"position": p, "first_step": runs[p][0]["step"], "iters": iters, "total_s": total, "cpu_s": cpu,
                        "samples_read_before_first_batch": samples, "phases_median_s": phases,
                        "ratio_vs_first": vs, "cpu_ratio_vs_first": cpu_vs})
        rows.append([p if p == "fresh" else f"{p:,}", f"{runs[p][0]['step']:,}/{iters:,}", samples, bc.spread(total, 2),
                     *(f"{v:.2f}" for v in phases.values()), f"{cpu['median']:.2f}", bc.spread(vs),
                     f"{cpu_vs['median']:.3f}"])
    ratio, cpu_ratio = results[-1]["ratio_vs_first"], results[-1]["cpu_ratio_vs_first"]
    text = bc.table(["resume at step", "first batch", "samples read", "launch→1st batch s med (min–max)",
                     *[k for k, _ in PHASES], "CPU s med", f"÷ step {first} med (min–max)", f"CPU ÷ step {first}"],
                    rows)
    verdict = (f"Step {last:,} / step {first}, launch → first trained batch: **{ratio['median']:.3f}** (median of "
               f"per-repetition ratios, min {ratio['min']:.3f}, max {ratio['max']:.3f}); target ≤ {TARGET_RATIO}: "
               f"{bc.yes(ratio['median'] <= TARGET_RATIO)}. CPU time of the process: {bc.spread(cpu_ratio)}.")
    return {"reps": reps, "lines": spec["lines"], "data": bc.rel(data), "data_bytes": data.stat().st_size,
            "batch_size": BATCH_SIZE, "max_seq_len": MAX_SEQ_LEN, "model": MODEL, "results": results,
            "ratio_last_vs_first": ratio, "cpu_ratio_last_vs_first": cpu_ratio, "target_ratio": TARGET_RATIO,
            "target_met": ratio["median"] <= TARGET_RATIO, "table": text, "verdict": verdict,
            "runs": {str(k): v for k, v in runs.items()}}


def plot(p: dict[str, Any], path: Path) -> Path:
    label = lambda r: str(r["position"]) if r["position"] == "fresh" else f"step {r['position']:,}"
    return bc.chart(path, ("resume cost vs position (medians)", "launch → first trained batch, s",
                           [(label(r), r["phases_median_s"], 0.0) for r in p["results"]]),
                    ("launch → first trained batch", "s (median, min–max)",
                     [(label(r), r["total_s"], "tab:blue") for r in p["results"]]), width=12)


if __name__ == "__main__":
    from benchmarks.run_all import main
    raise SystemExit(main(alone=NAME))
