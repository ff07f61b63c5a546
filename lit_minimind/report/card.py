"""The pipeline's report card: ``report.md`` and ``report.html`` (one self-contained file, its images embedded) in
the run directory, made from what the stages logged: ``pipeline.json`` (commands, attempts, wall times), each
stage's ``metrics.csv`` and ``config.yaml`` (the CSV logger's directory its summary named), ``eval/<stage>.json``
(the evaluation and the sample answers), and the library versions and the machine it runs on.

One list of blocks (:class:`Doc`) is written twice, as Markdown and as HTML; the curves are PNGs under
``report/`` (matplotlib, Agg).
"""

from __future__ import annotations

import base64
import csv
import html
import json
import os
import platform
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from lit_minimind.checkpoint.atomic import atomic_write_bytes

# the metrics a stage's final row shows, in this order, when it logged them
FINAL_METRICS = ("loss", "logits_loss", "dpo_loss", "reward_loss", "ce", "distill", "aux_loss", "mean_loss",
                 "rewards/accuracy", "rewards/margin", "val_loss", "val_reward_accuracy", "val_perplexity", "reward",
                 "kl_ref", "critic_loss", "avg_response_len", "learning_rate")
# the curve of a stage: the first of these it logged (GRPO: its reward), with its held-out loss when there is one
CURVES = (("reward", "kl_ref"), ("dpo_loss", "rewards/accuracy"), ("reward_loss", "rewards/accuracy"),
          ("loss", "distill"))
TASK_COLUMNS = (("mm_arc", "acc"), ("mm_arc", "acc_norm"), ("mm_cloze", "acc"), ("mm_cloze", "acc_norm"),
                ("mm_gen", "exact_match"), ("mm_ppl", "bits_per_byte"), ("mm_ppl", "byte_perplexity"))
LIBRARIES = ("torch", "lightning", "tokenizers", "numpy", "matplotlib", "PyYAML", "jsonargparse", "torchmetrics")


@dataclass
class Doc:
    """Blocks: ``("h", level, text)``, ``("p", text)``, ``("code", text)``, ``("table", header, rows)``,
    ``("img", path, alt)``, ``("list", items)``."""

    blocks: list[tuple] = field(default_factory=list)

    def add(self, *block: Any) -> None:
        self.blocks.append(block)

    def markdown(self) -> str:
        out = []
        for kind, *rest in self.blocks:
            if kind == "h":
                out.append(f"{'#' * rest[0]} {rest[1]}")
            elif kind == "p":
                out.append(rest[0])
            elif kind == "code":
                out.append(f"```\n{rest[0]}\n```")
            elif kind == "list":
                out.append("\n".join(f"- {item}" for item in rest[0]))
            elif kind == "img":
                out.append(f"![{rest[1]}]({rest[0]})")
            elif kind == "table":
                header, rows = rest

                def cell(v: Any) -> str:
                    return str(v).replace("|", "\\|").replace("\n", " ")

                out.append("\n".join(["| " + " | ".join(map(cell, header)) + " |", "|" + "---|" * len(header),
                                      *("| " + " | ".join(map(cell, row)) + " |" for row in rows)]))
        return "\n\n".join(out) + "\n"

    def html(self, run_dir: Path) -> str:
        body = []
        for kind, *rest in self.blocks:
            if kind == "h":
                body.append(f"<h{rest[0]}>{html.escape(rest[1])}</h{rest[0]}>")
            elif kind == "p":
                body.append(f"<p>{_inline(rest[0])}</p>")
            elif kind == "code":
                body.append(f"<pre><code>{html.escape(rest[0])}</code></pre>")
            elif kind == "list":
                body.append("<ul>" + "".join(f"<li>{_inline(i)}</li>" for i in rest[0]) + "</ul>")
            elif kind == "img":
                data = base64.b64encode((run_dir / rest[0]).read_bytes()).decode()
                body.append(f'<img src="data:image/png;base64,{data}" alt="{html.escape(rest[1])}">')
            elif kind == "table":
                header, rows = rest
                head = "".join(f"<th>{_inline(str(h))}</th>" for h in header)
                cells = "".join("<tr>" + "".join(f"<td>{_inline(str(c))}</td>" for c in row) + "</tr>" for row in rows)
                body.append(f"<table><thead><tr>{head}</tr></thead><tbody>{cells}</tbody></table>")
        return HTML.format(body="\n".join(body))


def _inline(text: str) -> str:
    """Markdown's inline code (`x`) and bold (**x**) as HTML, the rest escaped."""
    parts = html.escape(text).split("`")
    out = "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(parts))
    bold = out.split("**")
    return "".join(f"<b>{p}</b>" if i % 2 else p for i, p in enumerate(bold))


HTML = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>lit-minimind pipeline report</title>
<style>
body {{ font-family: -apple-system, "Segoe UI", Roboto, sans-serif; max-width: 1000px; margin: 2em auto; padding: 0 1em;
       color: #222; line-height: 1.45; }}
h1 {{ border-bottom: 2px solid #444; }} h2 {{ border-bottom: 1px solid #ccc; margin-top: 2em; }}
table {{ border-collapse: collapse; margin: 0.8em 0; font-size: 0.92em; }}
th, td {{ border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: left; vertical-align: top; }}
th {{ background: #f2f2f2; }} tr:nth-child(even) td {{ background: #fafafa; }}
pre {{ background: #f6f8fa; padding: 0.8em; overflow-x: auto; white-space: pre-wrap; word-break: break-all; }}
code {{ background: #f6f8fa; padding: 0 0.2em; }} img {{ max-width: 100%; }}
</style></head><body>
{body}
</body></html>
"""


# ----------------------------------------------------------------------------------------------- reading


def read_metrics(log_dir: Path) -> list[dict[str, float]]:
    """The rows of a stage's ``metrics.csv``, numbers only (empty cells left out)."""
    path = log_dir / "metrics.csv"
    if not path.is_file():
        return []
    rows = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            values = {}
            for key, value in row.items():
                try:
                    values[key] = float(value)
                except (TypeError, ValueError):
                    continue
            rows.append(values)
    return rows


def read_config(log_dir: Path) -> dict[str, Any]:
    import yaml

    path = log_dir / "config.yaml"
    return (yaml.safe_load(path.read_text()) or {}) if path.is_file() else {}


def last_values(rows: list[dict[str, float]]) -> dict[str, float]:
    last: dict[str, float] = {}
    for row in rows:
        last.update({k: v for k, v in row.items() if k in FINAL_METRICS})
    return {k: last[k] for k in FINAL_METRICS if k in last}


def seen(rows: list[dict[str, float]], config: dict[str, Any]) -> tuple[int, str]:
    """Optimizer steps, and what they trained on (samples; the RL stages' prompts and rollouts, counted by batch:
    PPO steps its optimizers several times a batch)."""
    steps = int(max((r.get("step", 0) for r in rows), default=0))
    data, trainer, model = config.get("data") or {}, config.get("trainer") or {}, config.get("model") or {}
    devices = int(trainer["devices"]) if str(trainer.get("devices")).isdigit() else 1
    per_batch = int(data.get("batch_size") or 0) * devices * int(trainer.get("num_nodes") or 1)
    samples = steps * per_batch * int(trainer.get("accumulate_grad_batches") or 1)
    objective = model.get("objective")
    if objective in ("grpo", "ppo", "agent"):
        prompts = int(max((r.get("micro_step", 0) for r in rows), default=0)) * per_batch
        rollouts = prompts * (1 if objective == "ppo" else int(model.get("num_generations") or 1))
        what = ("questions", "multi-turn rollouts") if objective == "agent" else ("prompts", "completions")
        return steps, f"{prompts:,} {what[0]}, {rollouts:,} {what[1]}"
    seq = data.get("max_seq_len")
    tokens = f" ({samples * int(seq):,} token positions of {seq})" if seq else ""
    return steps, f"{samples:,} samples{tokens}"


def curve(rows: list[dict[str, float]], name: str, target: Path) -> str | None:
    """A PNG of the stage's main metric (and its companion on a second axis) per optimizer step; its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    main, other = next(((a, b) for a, b in CURVES if any(a in r for r in rows)), (None, None))
    if main is None:
        return None
    points = sorted({int(r["step"]): r[main] for r in rows if main in r and "step" in r}.items())
    fig, ax = plt.subplots(figsize=(7, 3.2), dpi=110)
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    window = len(points) // 20 if len(points) > 60 else 1
    if window > 1:  # a long, noisy curve: the steps faint, their moving mean over it
        ax.plot(xs, ys, color="#1f77b4", lw=0.6, alpha=0.35)
        ys = [sum(ys[max(0, i - window + 1):i + 1]) / len(ys[max(0, i - window + 1):i + 1]) for i in range(len(ys))]
    ax.plot(xs, ys, color="#1f77b4", lw=1.4, label=main + (f" (mean of {window} steps)" if window > 1 else ""))
    ax.set_xlabel("optimizer step")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_ylabel(main, color="#1f77b4")
    ax.grid(alpha=0.3)
    extra = sorted({int(r["step"]): r[other] for r in rows if other in r and "step" in r}.items())
    if extra:
        ax2 = ax.twinx()
        ax2.plot([p[0] for p in extra], [p[1] for p in extra], color="#ff7f0e", lw=1.0, alpha=0.8, label=other)
        ax2.set_ylabel(other, color="#ff7f0e")
    val = sorted({int(r["step"]): r["val_loss"] for r in rows if "val_loss" in r and "step" in r}.items())
    if val and main.endswith("loss"):
        ax.plot([p[0] for p in val], [p[1] for p in val], "o", color="#2ca02c", label="val_loss")
    ax.set_title(f"{name}: {main}" + (f" and {other}" if extra else ""))
    handles = [h for a in fig.axes for h in a.get_legend_handles_labels()[0]]
    ax.legend(handles, [h.get_label() for h in handles], loc="best", fontsize=8)
    fig.tight_layout()
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target)
    plt.close(fig)
    return str(target)


def eval_chart(results: dict[str, dict[str, Any]], target: Path) -> str | None:
    """Accuracy on the multiple-choice tasks per stage, as grouped bars; its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = [s for s, r in results.items() if r.get("tasks")]
    if not stages:
        return None
    columns = [("mm_arc", "acc"), ("mm_cloze", "acc"), ("mm_gen", "exact_match")]
    fig, ax = plt.subplots(figsize=(7, 3.2), dpi=110)
    width = 0.8 / len(columns)
    for i, (task, metric) in enumerate(columns):
        values = [results[s]["tasks"][task][metric] for s in stages]
        ax.bar([x + i * width for x in range(len(stages))], values, width, label=f"{task} {metric}")
    ax.axhline(0.25, color="grey", ls="--", lw=0.8, label="chance (4 choices)")
    ax.set_xticks([x + width for x in range(len(stages))], stages)
    ax.set_ylim(0, 1)
    ax.set_title("the shipped tasks after each stage")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=4, frameon=False)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target)
    plt.close(fig)
    return str(target)


def versions() -> list[tuple[str, str]]:
    out = [("python", platform.python_version())]
    for name in ("lit-minimind", *LIBRARIES):
        try:
            out.append((name, metadata.version(name)))
        except metadata.PackageNotFoundError:
            continue
    return out


def machine() -> list[tuple[str, str]]:
    cpu = platform.processor() or platform.machine()
    try:
        names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    rows = [("system", f"{platform.system()} {platform.release()}"), ("cpu", cpu),
            ("cores", f"{len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()} usable")]
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        rows.append(("memory", f"{pages * size / 2**30:.1f} GiB"))
    except (ValueError, OSError, AttributeError):
        pass
    import torch

    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    rows.append(("gpu", ", ".join(gpus) or "none"))
    return rows


def _duration(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


def _number(value: float) -> str:
    if value and abs(value) < 0.001:
        return f"{value:.2e}"  # a learning rate at the end of its schedule
    return f"{value:.4f}" if abs(value) < 1000 else f"{value:,.1f}"


# ----------------------------------------------------------------------------------------------- the card


def build(run_dir: Path) -> Doc:
    record = json.loads((run_dir / "pipeline.json").read_text())
    plan = dict((name, settings) for name, settings in record["plan"])
    fits = [name for name, s in plan.items() if s.get("kind") == "fit"]
    evals = {n: json.loads((run_dir / "eval" / f"{n}.json").read_text()) for n in fits
             if (run_dir / "eval" / f"{n}.json").is_file()}
    doc = Doc()
    doc.add("h", 1, "lit-minimind pipeline report")
    trained = sum(record["steps"][n]["wall_s"] for n in plan if n != "report")
    doc.add("p", f"Run directory `{run_dir.resolve()}`, config `{record['config']}` (digest `{record['digest']}`): "
                 f"{len(fits)} training stages, {_duration(trained)} of wall time before this report. Every command "
                 f"below runs in the run directory and continues a killed run exactly (`--ckpt_path last`).")

    doc.add("h", 2, "Stages")
    rows, details = [], {}
    for name in [n for n in plan if plan[n].get("kind") in ("tokenizer", "fit")]:
        entry = record["steps"][name]
        log_dir = run_dir / entry["logs"] if entry.get("logs") else None
        metrics = read_metrics(log_dir) if log_dir else []
        config = read_config(log_dir) if log_dir else {}
        steps, amount = seen(metrics, config) if metrics else (0, "-")
        final = last_values(metrics)
        main = next((k for k in ("reward", "dpo_loss", "reward_loss", "loss") if k in final), None)
        attempts = len(entry["attempts"])
        rows.append([f"**{name}**", entry["status"], _duration(entry["wall_s"]) + (f" ({attempts} runs)" if attempts > 1 else ""),
                     steps or "-", amount, f"{main} {_number(final[main])}" if main else "-",
                     f"`{plan[name].get('weights') or plan[name].get('out_dir', '-')}`"])
        details[name] = (entry, metrics, final, log_dir)
    doc.add("table", ["stage", "status", "wall time", "steps", "trained on", "final", "output"], rows)

    if evals:
        doc.add("h", 2, "Evaluation after each stage")
        with_tasks = {n: e for n, e in evals.items() if e.get("tasks")}
        if with_tasks:
            doc.add("p", "The shipped tasks (`tests/fixtures/eval`: 24 Python questions in ARC's layout, 24 cloze items "
                         "and 24 sentence ends from the embedded corpus, 12 sentences for perplexity), scored in this "
                         "project's venv as lm-evaluation-harness scores them through `python -m lit_minimind.eval` "
                         "(`tests/test_eval.py` checks lm-eval against the same computation; lm-eval's `.venv-eval` is "
                         "not needed). Chance is 0.25 for the 4-choice tasks; bits per byte and perplexity: lower is better.")
            header = ["stage", *(f"{t} {m}" for t, m in TASK_COLUMNS)]
            doc.add("table", header, [[n, *(_number(e["tasks"][t][m]) for t, m in TASK_COLUMNS)]
                                      for n, e in with_tasks.items()])
            chart = eval_chart(with_tasks, run_dir / "report" / "evaluation.png")
            if chart:
                doc.add("img", "report/evaluation.png", "accuracy on the shipped tasks after each stage")
        else:
            doc.add("p", "No shipped tasks were found (they live in a checkout's `tests/fixtures/eval`): samples only.")

    for name, (entry, metrics, final, log_dir) in details.items():
        doc.add("h", 2, f"Stage: {name}")
        doc.add("code", f"cd {run_dir.resolve()} && {entry['command']}")
        facts = [f"wall time {_duration(entry['wall_s'])} over {len(entry['attempts'])} run(s)"
                 + "".join(f"; run {i} resumed at {a['resumed_at']}" for i, a in enumerate(entry["attempts"], 1)
                           if a.get("resumed_at"))]
        if log_dir is not None:
            facts.append(f"logged: `{os.path.relpath(log_dir, run_dir)}/metrics.csv` ({len(metrics)} rows), "
                         f"its whole configuration `config.yaml` beside it; output `logs/{name}.log`")
        doc.add("list", facts)
        if final:
            doc.add("table", ["final " + k for k in final], [[_number(v) for v in final.values()]])
        if metrics and curve(metrics, name, run_dir / "report" / f"{name}.png"):
            doc.add("img", f"report/{name}.png", f"{name}: training curve")
        if name in evals and evals[name].get("samples"):
            chat = plan[name].get("chat", True)
            doc.add("p", f"Greedy {'answers (a fresh conversation each)' if chat else 'continuations'} of `{evals[name]['weights']}`:")
            doc.add("table", ["question" if chat else "prompt", "answer" if chat else "continuation"],
                    [[s["prompt"], s["answer"].strip() or "(nothing)"] for s in evals[name]["samples"]])

    doc.add("h", 2, "Environment")
    doc.add("table", ["library", "version"], versions())
    doc.add("table", ["machine", ""], machine())
    return doc


def write_card(run_dir: Path) -> int:
    doc = build(run_dir)
    atomic_write_bytes(doc.markdown(), run_dir / "report.md")
    atomic_write_bytes(doc.html(run_dir), run_dir / "report.html")
    print(f"report: {run_dir / 'report.md'}, {run_dir / 'report.html'}", flush=True)
    return 0
