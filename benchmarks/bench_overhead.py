"""Port overhead: training tokens/s of python -m lit_minimind.fit vs a plain PyTorch loop of the same training.

Both sides are processes, alternating, training the same model (seed 42), batches, AdamW, fp32, accumulation, LR rule
and clipping: the real CLI with :class:`benchmarks.probes.Probe` on its command line, and
:func:`benchmarks.probes.plain_loop` (MiniMind's ``train_epoch``). Tokens/s over the steady-state window; headline:
the median per-pair ratio port / plain (last losses must agree), also by CPU time. Attribution (``loop_overhead_ms``,
target <= 0.6 ms): a 64x1 model stepping every micro-batch, both sides stamped at the same boundaries (torch's forward
and optimizer-step hooks, Lightning's callback hooks); a micro-batch minus forward, backward, clip + AdamW and the data
(timed alone over the same loader) is the loop's cost, port minus plain the port's; every phase goes to
``loop_phases.json``. Not with ``--quick``: ``--model.compile true`` vs eager (cold compile: the first compiled run's
launch -> first batch minus the eager one's, in a fresh inductor cache).
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks import common as bc

NAME = "overhead"
ARGS = [(["--no-compile"], {"action": "store_true", "help": "skip the --model.compile true runs (a minute of compiling)"})]
TARGET_RATIO, TARGET_LOOP_OVERHEAD_MS = 0.97, 0.6
SHARED = ("forward", "backward", "step")  # stamped [ and ] on both sides; "step": clipping + the AdamW update


@dataclass
class Config:
    name: str
    hidden_size: int
    num_hidden_layers: int
    max_seq_len: int
    batch_size: int
    accumulate: int
    learning_rate: float
    warmup_batches: int  # micro-batches before the timed window (multiple of accumulate)
    timed_batches: int  # micro-batches in the timed window (multiple of accumulate)
    log_interval: int = 10
    note: str = ""
    accelerator: str = "cpu"
    precision: str = "32-true"
    num_workers: int = 0

    @property
    def batches(self) -> int:
        return self.warmup_batches + self.timed_batches

    @property
    def tokens_per_batch(self) -> int:
        return self.batch_size * self.max_seq_len


FULL_CONFIGS = [
    Config("tiny default 128x2", 128, 2, 128, 16, 1, 2e-3, 4, 24, note="conf/default.yaml model and data shape; 4 warm-up + 24 timed micro-batches per run"),
    Config("512x8 seq256", 512, 8, 256, 2, 2, 5e-4, 2, 10, note="small on purpose for a CPU: batch 2, accumulation 2, 2 warm-up + 10 timed micro-batches per run"),
]
QUICK_CONFIGS = [Config("quick 64x1", 64, 1, 32, 4, 2, 1e-3, 2, 6, log_interval=2)]
ATTRIBUTION = Config("64x1 seq32 batch4", 64, 1, 32, 4, 1, 1e-3, 8, 64, log_interval=10)
QUICK_ATTRIBUTION = replace(ATTRIBUTION, name="quick 64x1", warmup_batches=2, timed_batches=8, log_interval=2)
COMPILE = Config("tiny default 128x2", 128, 2, 128, 16, 1, 2e-3, 6, 16, note="6 warm-up (the compile) + 16 timed micro-batches per run")
PORT = {"lightning": {}, "compiled": {"model.compile": "true"}, "port": {}, "port_nondeterministic": {"trainer.deterministic": "false"}}


def side_cmd(side: str, cfg: Config, data: Path, tok: Path, work: Path, stamps: bool) -> list[str]:
    """The command of one run: ``plain`` (the plain loop) or a port side (the CLI with the flags of ``PORT[side]``)."""
    data_batches = 32 if stamps else 0
    if side == "plain":
        return [sys.executable, "-m", "benchmarks.probes", json.dumps({
            **asdict(cfg), "batches": cfg.batches, "data": str(data), "tokenizer": str(tok), "stamps": stamps,
            "data_batches": data_batches, "deterministic": True, "device": "cuda" if cfg.accelerator == "gpu" else "cpu"})]
    flags = {"model.hidden_size": cfg.hidden_size, "model.num_hidden_layers": cfg.num_hidden_layers,
             "model.learning_rate": cfg.learning_rate, "data.max_seq_len": cfg.max_seq_len, "data.batch_size": cfg.batch_size,
             "data.num_workers": cfg.num_workers, "trainer.max_steps": cfg.batches // cfg.accumulate,
             "trainer.accumulate_grad_batches": cfg.accumulate, "trainer.accelerator": cfg.accelerator,
             "trainer.precision": cfg.precision, "log_interval": cfg.log_interval, **PORT[side]}
    return bc.fit_cmd(work, data, tok, flags, *bc.probe(stamps=stamps, warmup=cfg.warmup_batches, data_batches=data_batches))


def one(side: str, cfg: Config, data: Path, tok: Path, stamps: bool = False, env: dict[str, str] | None = None,
        timeout: Any = None) -> dict[str, Any]:
    """One run of ``side``: its probe's end event plus tokens/s by wall clock and by CPU time, launch -> first batch
    (``timeout()``: the seconds it may take)."""
    with tempfile.TemporaryDirectory(prefix="bench-overhead-", dir=bc.cache_dir()) as tmp:
        run = bc.launch(side_cmd(side, cfg, data, tok, Path(tmp), stamps), Path(tmp), env=env, timeout=timeout() if timeout else 900)
    end = bc.event(run, "end")
    assert end is not None and len(end["ends"]) == cfg.batches, (side, end and len(end["ends"]))
    first, last = end["ends"][cfg.warmup_batches - 1], end["ends"][cfg.batches - 1]
    tokens = cfg.timed_batches * cfg.tokens_per_batch
    return {**end, "tokens_per_s": tokens / (last[0] - first[0]), "cpu_tokens_per_s": tokens / (last[1] - first[1]),
            "start_to_first_batch_s": bc.event(run, "batch_end")["t"]}


def compare(cfg: Config, sides: list[str], data: Path, tok: Path, reps: int, warmup: bool = True, stamps: bool = False,
            env: dict[str, str] | None = None, label: str = "", timeout: Any = None) -> dict[str, list[dict[str, Any]]]:
    """``reps`` rotated repetitions of every side (after a warm-up run of each): each side's runs."""
    if warmup:
        bc.say(f"  [{label or cfg.name}] warm-up run of each side ...")
        for side in sides:
            one(side, cfg, data, tok, stamps, env, timeout)
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in sides}
    for rep in range(reps):
        for side in bc.alternating(sides, rep):
            runs[side].append(one(side, cfg, data, tok, stamps, env, timeout))
        bc.say(f"  [{label or cfg.name}] rep {rep + 1}/{reps}: " + ", ".join(f"{s} {runs[s][-1]['tokens_per_s']:,.0f} tok/s" for s in sides))
    return runs


def ratio(runs: dict[str, list[dict[str, Any]]], a: str, b: str, key: str = "tokens_per_s") -> dict[str, Any]:
    """``a / b`` within each repetition."""
    return bc.stats([x[key] / y[key] for x, y in zip(runs[a], runs[b])])


def measure(cfg: Config, data: Path, tok: Path, reps: int, quick: bool) -> dict[str, Any]:
    runs = compare(cfg, ["plain", "lightning"], data, tok, reps, warmup=not quick)
    r = {"config": asdict(cfg), "params": runs["plain"][0]["params"], "ratio": ratio(runs, "lightning", "plain"),
         "cpu_ratio": ratio(runs, "lightning", "plain", "cpu_tokens_per_s"), "target_ratio": TARGET_RATIO,
         "max_abs_last_loss_diff": max(abs(p["last_loss"] - q["last_loss"]) for p, q in zip(runs["plain"], runs["lightning"]))}
    for side in runs:
        r[f"{side}_tokens_per_s"] = bc.stats([x["tokens_per_s"] for x in runs[side]])
        r[f"{side}_start_to_first_batch_s"] = bc.stats([x["start_to_first_batch_s"] for x in runs[side]])
        r[f"{side}_ms_per_batch"] = 1000 * cfg.tokens_per_batch / r[f"{side}_tokens_per_s"]["median"]
    r["target_met"] = r["ratio"]["median"] >= TARGET_RATIO
    return r


def phases(run: dict[str, Any], cfg: Config) -> dict[str, list[float]]:
    """ms of every phase ``a -> b`` between consecutive stamps, per timed micro-batch."""
    out: dict[str, list[float]] = {}
    for i in range(max(cfg.warmup_batches, 1), cfg.batches):
        seq = [run["marks"][i - 1][-1], *run["marks"][i]]
        for (a, ta), (b, tb) in zip(seq, seq[1:]):
            out.setdefault(f"{a} -> {b}", []).append(1000 * (tb - ta))
    return out


def attribution(cfg: Config, data: Path, tok: Path, reps: int, quick: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """Where a micro-batch goes on each side (medians over batches, then over runs), and the phase table."""
    runs = compare(cfg, ["plain", "lightning"], data, tok, reps, warmup=not quick, stamps=True, label=f"attribution {cfg.name}")
    per_run: dict[str, list[dict[str, float]]] = {s: [] for s in runs}
    phase_ms: dict[str, dict[str, list[float]]] = {s: {} for s in runs}
    for side, side_runs in runs.items():
        for run in side_runs:
            for k, v in phases(run, cfg).items():
                phase_ms[side].setdefault(k, []).extend(v)
            rows = []
            for i in range(cfg.warmup_batches, cfg.batches):
                t = dict(run["marks"][i])
                parts = {part: 1000 * (t[f"{part}]"] - t[f"{part}["]) for part in SHARED}
                batch = 1000 * (run["ends"][i][0] - run["ends"][i - 1][0])
                rows.append({"batch": batch, "data": run["data_ms"], **parts, "loop": batch - run["data_ms"] - sum(parts.values())})
            # the mean also counts what happens every log_interval only (the console's line, the logger's rows)
            per_run[side].append({**{k: statistics.median(r[k] for r in rows) for k in rows[0]},
                                  "loop (mean)": statistics.fmean(r["loop"] for r in rows)})
    ms = {side: {k: bc.stats([r[k] for r in rs]) for k in rs[0]} for side, rs in per_run.items()}
    diff = lambda key: bc.stats([lt[key] - p[key] for p, lt in zip(per_run["plain"], per_run["lightning"])])
    loop_phases = {"config": asdict(cfg), "reps": reps}
    for side, got in phase_ms.items():
        medians = {k: statistics.median(v) for k, v in got.items()}
        shared = {k: m for k, m in medians.items() if k in {f"{p}[ -> {p}]" for p in SHARED}}
        loop = {k: m for k, m in medians.items() if k not in shared}
        data_alone = ms[side]["data"]["median"]
        loop_phases[side] = {"phases_ms": loop, "shared_ms": shared, "data_ms": data_alone,
                             "loop_ms": sum(loop.values()) - data_alone, "shared_total_ms": sum(shared.values())}
    loop_phases["lightning_minus_plain_loop_ms"] = loop_phases["lightning"]["loop_ms"] - loop_phases["plain"]["loop_ms"]
    loop_phases["table"] = render_phases(loop_phases)
    return {"config": asdict(cfg), "ms_per_batch": ms, "lightning_minus_plain_loop_ms": diff("loop"),
            "lightning_minus_plain_loop_mean_ms": diff("loop (mean)")}, loop_phases


def compile_measure(cfg: Config, data: Path, tok: Path, reps: int) -> dict[str, Any]:
    """Eager vs ``--model.compile true`` through the CLI, alternating; every run in one fresh inductor cache."""
    with tempfile.TemporaryDirectory(prefix="bench-inductor-", dir=bc.cache_dir()) as inductor:
        bc.say(f"  [compile {cfg.name}] the first compiled run compiles (about a minute on a CPU) ...")
        runs = compare(cfg, ["lightning", "compiled"], data, tok, reps, warmup=False,
                       env=bc.child_env(TORCHINDUCTOR_CACHE_DIR=inductor), label=f"compile {cfg.name}")
    return {"config": asdict(cfg), "params": runs["lightning"][0]["params"],
            "eager_tokens_per_s": bc.stats([r["tokens_per_s"] for r in runs["lightning"]]),
            "compiled_tokens_per_s": bc.stats([r["tokens_per_s"] for r in runs["compiled"]]),
            "speedup": ratio(runs, "compiled", "lightning"), "cpu_speedup": ratio(runs, "compiled", "lightning", "cpu_tokens_per_s"),
            "compile_s_estimate": runs["compiled"][0]["start_to_first_batch_s"] - runs["lightning"][0]["start_to_first_batch_s"],
            "max_abs_last_loss_diff": max(abs(c["last_loss"] - e["last_loss"]) for c, e in zip(runs["compiled"], runs["lightning"]))}


def render_compile(c: dict[str, Any]) -> str:
    cfg, e, k = c["config"], c["eager_tokens_per_s"], c["compiled_tokens_per_s"]
    return bc.table(["config", "params", "batch", "eager tok/s med (min–max)", "compiled tok/s med (min–max)",
                  "compiled / eager med (min–max)", "CPU-time ratio med", "cold compile s", "Δ last loss"],
                 [[cfg["name"], f"{c['params'] / 1e6:.1f}M", f"{cfg['batch_size']}x{cfg['max_seq_len']}, acc {cfg['accumulate']}",
                   f"{bc.fmt_num(e['median'])} ({bc.fmt_num(e['min'])}–{bc.fmt_num(e['max'])})",
                   f"{bc.fmt_num(k['median'])} ({bc.fmt_num(k['min'])}–{bc.fmt_num(k['max'])})", f"**{bc.spread(c['speedup'])}**",
                   f"{c['cpu_speedup']['median']:.3f}", f"{c['compile_s_estimate']:.0f}", f"{c['max_abs_last_loss_diff']:.1e}"]])


def render_attribution(at: dict[str, Any]) -> str:
    names = {"batch": "whole micro-batch", "data": "data (the same loader, alone)", "step": "clip + AdamW update",
             "loop": "loop = whole − (data + forward + backward + clip + AdamW)"}
    p, lt = at["ms_per_batch"]["plain"], at["ms_per_batch"]["lightning"]
    rows = [[names.get(k, k), f"{p[k]['median']:.3f}", bc.spread(lt[k])] for k in ("batch", "data", *SHARED, "loop")]
    rows.append(["**port overhead = port loop − plain loop**", "", f"**{bc.spread(at['lightning_minus_plain_loop_ms'])}**"])
    return bc.table(["ms per micro-batch (median)", "plain", "port med (min–max over runs)"], rows)


def render_phases(result: dict[str, Any]) -> str:
    rows = [[side, phase, f"{ms:.3f}"] for side in ("plain", "lightning") for phase, ms in result[side]["phases_ms"].items() if ms >= 0.005]
    for side in ("plain", "lightning"):
        rows.append([side, "**loop ms (the phases above minus the data alone)**", f"**{result[side]['loop_ms']:.3f}**"])
    rows.append(["", "**port − plain**", f"**{result['lightning_minus_plain_loop_ms']:+.3f}**"])
    return bc.table(["side", "phase (between consecutive stamps; medians)", "ms per micro-batch"], rows)


def render(results: list[dict[str, Any]]) -> str:
    rows = [[r["config"]["name"], f"{r['params'] / 1e6:.1f}M", f"{r['config']['batch_size']}x{r['config']['max_seq_len']}, acc {r['config']['accumulate']}",
             *(f"{bc.fmt_num(s['median'])} ({bc.fmt_num(s['min'])}–{bc.fmt_num(s['max'])})" for s in (r["plain_tokens_per_s"], r["lightning_tokens_per_s"])),
             f"**{bc.spread(r['ratio'])}**", bc.spread(r["cpu_ratio"]), f"≥ {r['target_ratio']}: {'yes' if r['target_met'] else 'NO'}",
             f"{r['max_abs_last_loss_diff']:.1e}"] for r in results]
    return bc.table(["config", "params", "batch", "plain tok/s med (min–max)", "port tok/s med (min–max)", "ratio med (min–max)",
                  "CPU-time ratio med (min–max)", "target", "Δ last loss"], rows)


def plot(p: dict[str, Any], path: Path) -> Path:
    plt = bc.pyplot()
    results, ms = p["results"], p["attribution"]["ms_per_batch"]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(12, 3.6), gridspec_kw={"width_ratios": [1.2, 1, 1]})
    names = [r["config"]["name"] for r in results]
    for i, r in enumerate(results):
        for j, (side, color) in enumerate((("plain", "tab:gray"), ("lightning", "tab:purple"))):
            s = r[f"{side}_tokens_per_s"]
            ax1.bar(i + (j - 0.5) * 0.38, s["median"], 0.36, color=color, yerr=[[s["median"] - s["min"]], [s["max"] - s["median"]]],
                    capsize=3, label=("plain" if j == 0 else "port") if i == 0 else None)
        ax2.plot([i] * r["ratio"]["n"], r["ratio"]["values"], "o", color="tab:purple", alpha=0.5)
        ax2.plot([i - 0.2, i + 0.2], [r["ratio"]["median"]] * 2, "-", color="black")
    ax1.set_yscale("log")
    ax1.set_xticks(range(len(names)), names)
    ax1.set(ylabel="tokens/s (median, min–max)", title="training throughput")
    ax1.legend(fontsize=8)
    ax2.axhline(TARGET_RATIO, color="tab:red", ls="--", lw=1, label=f"target {TARGET_RATIO}")
    ax2.set_xticks(range(len(names)), names)
    ax2.set(xlim=(-0.5, len(names) - 0.5), ylabel="port / plain (per pair)", title="port overhead")
    ax2.legend(fontsize=8)
    for x, side in enumerate(("plain", "lightning")):
        bottom = 0.0
        for part, color in (("data", "tab:olive"), ("forward", "tab:blue"), ("backward", "tab:cyan"), ("step", "tab:green"), ("loop", "tab:red")):
            value = max(0.0, ms[side][part]["median"])
            ax3.bar(x, value, 0.5, bottom=bottom, color=color, label=part if x == 0 else None)
            bottom += value
    ax3.set_xticks([0, 1], ["plain", "port"])
    ax3.set(ylabel="ms per micro-batch (median)", title=f"where a micro-batch goes\n({p['attribution']['config']['name']})")
    ax3.legend(fontsize=7)
    return bc.save_figure(fig, path)


def run(quick: bool = False, reps: int | None = None, no_compile: bool = False) -> dict[str, Any]:
    reps = reps or (2 if quick else 5)
    data, tok = bc.default_data()
    results = [measure(cfg, data, tok, reps, quick) for cfg in (QUICK_CONFIGS if quick else FULL_CONFIGS)]
    comp = compile_measure(COMPILE, data, tok, min(reps, 3)) if not (quick or no_compile) else None
    at, loop_phases = attribution(QUICK_ATTRIBUTION if quick else ATTRIBUTION, data, tok, reps, quick)
    overhead = at["lightning_minus_plain_loop_ms"]["median"]
    return {"reps": reps, "data": bc.rel(data), "tokenizer": bc.rel(tok), "results": results, "table": render(results),
            "notes": [f"- {r['config']['name']}: {r['config']['note']}" for r in results if r["config"]["note"]],
            "compile": comp or {"skipped": "--quick" if quick else "--no-compile"}, "compile_table": render_compile(comp) if comp else "",
            "attribution": at, "attribution_table": render_attribution(at),
            "loop_overhead_ms": overhead, "loop_overhead_mean_ms": at["lightning_minus_plain_loop_mean_ms"]["median"],
            "loop_overhead_target_ms": TARGET_LOOP_OVERHEAD_MS,
            "loop_overhead_target_met": overhead <= TARGET_LOOP_OVERHEAD_MS,
            "loop_overhead_verdict": f"loop overhead: {overhead:+.3f} ms per micro-batch (target <= {TARGET_LOOP_OVERHEAD_MS}: "
                                     f"{'yes' if overhead <= TARGET_LOOP_OVERHEAD_MS else 'NO'})",
            "loop_phases_table": loop_phases["table"], "also_written": {"loop_phases": loop_phases}}


if __name__ == "__main__":
    raise SystemExit(bc.bench_main(sys.modules[__name__]))
