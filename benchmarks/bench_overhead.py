"""Port overhead: training tokens/s of python -m lit_minimind.fit vs a plain PyTorch loop of the same training.

Each run a process, the sides alternating after a warm-up run of each: the CLI with :class:`benchmarks.probes.Probe`
vs :func:`benchmarks.probes.plain_loop` (MiniMind's ``train_epoch``: the same model, batches, AdamW, accumulation, LR
rule, clipping). Tokens/s after the warm-up micro-batches; ratio = port / plain within a repetition (target >= 0.97);
Δ last loss 0: the same training. The loop's cost (``loop_overhead_ms``, target <= 0.6 ms): a 64x1 model, both sides
stamped at the same hooks; a micro-batch minus forward, backward, clip + AdamW and the data (timed alone) is the loop;
every phase between stamps also in ``loop_phases.json``. Not with ``--quick``: ``--model.compile true`` vs eager (at
most 3 repetitions; cold compile: the first compiled run's extra launch -> first batch, in a fresh inductor cache).
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks import common as bc

NAME = "overhead"
ARGS = [(["--no-compile"], {"action": "store_true", "help": "skip the --model.compile true runs (a minute)"})]
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
    accelerator: str = "cpu"
    precision: str = "32-true"
    num_workers: int = 0

    @property
    def batches(self) -> int:
        return self.warmup_batches + self.timed_batches

    @property
    def tokens_per_batch(self) -> int:
        return self.batch_size * self.max_seq_len

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return self.hidden_size, self.num_hidden_layers, self.max_seq_len, self.batch_size


FULL_CONFIGS = [Config("tiny default 128x2", 128, 2, 128, 16, 1, 2e-3, 4, 24),  # conf/default.yaml's shape
                Config("512x8 seq256", 512, 8, 256, 2, 2, 5e-4, 2, 10)]  # small on purpose for a CPU
QUICK_CONFIGS = [Config("quick 64x1", 64, 1, 32, 4, 2, 1e-3, 2, 6, log_interval=2)]
ATTRIBUTION = Config("64x1 seq32 batch4", 64, 1, 32, 4, 1, 1e-3, 8, 64, log_interval=10)
QUICK_ATTRIBUTION = replace(ATTRIBUTION, name="quick 64x1", warmup_batches=2, timed_batches=8, log_interval=2)
COMPILE = Config("tiny default 128x2", 128, 2, 128, 16, 1, 2e-3, 6, 16)  # 6 warm-up batches: the compile
PORT = {"lightning": {}, "compiled": {"model.compile": "true"}, "port": {},
        "port_nondeterministic": {"trainer.deterministic": "false"}}


def side_cmd(side: str, cfg: Config, data: Path, tok: Path, work: Path, stamps: bool) -> list[str]:
    """The command of one run: ``plain`` (the plain loop) or a port side (the CLI with the flags of ``PORT[side]``)."""
    data_batches = 32 if stamps else 0
    if side == "plain":
        return [sys.executable, "-m", "benchmarks.probes", json.dumps({
            **asdict(cfg), "batches": cfg.batches, "data": str(data), "tokenizer": str(tok), "stamps": stamps,
            "data_batches": data_batches})]
    flags = {"model.learning_rate": cfg.learning_rate, "data.num_workers": cfg.num_workers,
             "trainer.max_steps": cfg.batches // cfg.accumulate, "trainer.accumulate_grad_batches": cfg.accumulate,
             "trainer.accelerator": cfg.accelerator, "trainer.precision": cfg.precision,
             "log_interval": cfg.log_interval, **PORT[side]}
    probe = bc.probe(stamps=stamps, warmup=cfg.warmup_batches, data_batches=data_batches)
    return bc.fit_cmd(work, data, tok, cfg.shape, flags, *probe)


def one(side: str, cfg: Config, data: Path, tok: Path, stamps: bool = False, env: dict[str, str] | None = None,
        timeout: Any = None) -> dict[str, Any]:
    """One run of ``side``: its probe's end event plus tokens/s by wall clock and by CPU time, launch -> first batch
    (``timeout()``: the seconds it may take)."""
    with bc.workdir("overhead") as work:
        run = bc.launch(side_cmd(side, cfg, data, tok, work, stamps), work, env, timeout() if timeout else 900)
    end = bc.event(run, "end")
    assert end is not None and len(end["ends"]) == cfg.batches, (side, end and len(end["ends"]))
    first, last = end["ends"][cfg.warmup_batches - 1], end["ends"][cfg.batches - 1]
    tokens = cfg.timed_batches * cfg.tokens_per_batch
    return {**end, "tokens_per_s": tokens / (last[0] - first[0]), "cpu_tokens_per_s": tokens / (last[1] - first[1]),
            "start_to_first_batch_s": bc.event(run, "batch_end")["t"]}


def compare(cfg: Config, sides: list[str], data: Path, tok: Path, reps: int, warmup: bool = True, stamps: bool = False,
            env: dict[str, str] | None = None, label: str = "", timeout: Any = None) -> dict[str, list[dict[str, Any]]]:
    """``reps`` rotated repetitions of every side (after a warm-up run of each): each side's runs."""
    bc.say(f"  [{label or cfg.name}] {', '.join(sides)}" + (", after a warm-up run of each" if warmup else ""))
    return bc.rotated(sides, reps, lambda side: one(side, cfg, data, tok, stamps, env, timeout),
                      warmup=sides if warmup else (), note=lambda r: f"{r['tokens_per_s']:,.0f} tok/s")


def versus(cfg: Config, runs: dict[str, list[dict[str, Any]]], base: str, other: str, key: str) -> dict[str, Any]:
    """``other`` against ``base``: each side's tokens/s, ``other / base`` by wall clock (``key``) and CPU time
    (``cpu_<key>``), the largest difference of their last losses."""
    return {"config": asdict(cfg), "params": runs[base][0]["params"],
            key: bc.ratios(runs[other], runs[base], "tokens_per_s"),
            f"cpu_{key}": bc.ratios(runs[other], runs[base], "cpu_tokens_per_s"),
            **{f"{side}_tokens_per_s": bc.stats(runs[side], "tokens_per_s") for side in (base, other)},
            "max_abs_last_loss_diff": max(abs(x["last_loss"] - y["last_loss"])
                                          for x, y in zip(runs[base], runs[other]))}


def measure(cfg: Config, data: Path, tok: Path, reps: int, quick: bool) -> dict[str, Any]:
    runs = compare(cfg, ["plain", "lightning"], data, tok, reps, warmup=not quick)
    r = {**versus(cfg, runs, "plain", "lightning", "ratio"), "target_ratio": TARGET_RATIO}
    for side in runs:
        r[f"{side}_start_to_first_batch_s"] = bc.stats(runs[side], "start_to_first_batch_s")
        r[f"{side}_ms_per_batch"] = 1000 * cfg.tokens_per_batch / r[f"{side}_tokens_per_s"]["median"]
    r["target_met"] = r["ratio"]["median"] >= TARGET_RATIO
    return r


def compile_measure(cfg: Config, data: Path, tok: Path, reps: int) -> dict[str, Any]:
    """Eager vs ``--model.compile true`` through the CLI, alternating; every run in one fresh inductor cache."""
    with bc.workdir("inductor") as inductor:
        bc.say(f"  [compile {cfg.name}] the first compiled run compiles (about a minute on a CPU) ...")
        runs = compare(cfg, ["lightning", "compiled"], data, tok, reps, warmup=False,
                       env=bc.child_env(TORCHINDUCTOR_CACHE_DIR=str(inductor)), label=f"compile {cfg.name}")
    out = versus(cfg, {"eager": runs["lightning"], "compiled": runs["compiled"]}, "eager", "compiled", "speedup")
    start = [runs[side][0]["start_to_first_batch_s"] for side in ("compiled", "lightning")]
    return {**out, "compile_s_estimate": start[0] - start[1]}


def attribution(cfg: Config, data: Path, tok: Path, reps: int, quick: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """Where a micro-batch goes on each side (medians over batches, then over runs), and every phase ``a -> b``
    between consecutive stamps (``loop_phases.json``)."""
    runs = compare(cfg, ["plain", "lightning"], data, tok, reps, warmup=not quick, stamps=True,
                   label=f"attribution {cfg.name}")
    per_run: dict[str, list[dict[str, float]]] = {}
    loop_phases: dict[str, Any] = {"config": asdict(cfg), "reps": reps}
    for side, side_runs in runs.items():
        per_run[side], phase_ms = [], {}
        for run in side_runs:
            rows = []
            for i in range(cfg.warmup_batches, cfg.batches):
                stamps = [run["marks"][i - 1][-1], *run["marks"][i]]  # from the end of the batch before
                for (a, ta), (b, tb) in zip(stamps, stamps[1:]):
                    phase_ms.setdefault(f"{a} -> {b}", []).append(1000 * (tb - ta))
                t = dict(run["marks"][i])
                parts = {part: 1000 * (t[f"{part}]"] - t[f"{part}["]) for part in SHARED}
                batch = 1000 * (run["ends"][i][0] - run["ends"][i - 1][0])
                rows.append({"batch": batch, "data": run["data_ms"], **parts,
                             "loop": batch - run["data_ms"] - sum(parts.values())})
            # the mean also counts what happens every log_interval only (the console's line, the logger's rows)
            per_run[side].append({**{k: statistics.median(r[k] for r in rows) for k in rows[0]},
                                  "loop (mean)": statistics.fmean(r["loop"] for r in rows)})
        medians = {k: statistics.median(v) for k, v in phase_ms.items()}
        shared = {k: medians.pop(k) for k in [f"{p}[ -> {p}]" for p in SHARED] if k in medians}
        data_ms = statistics.median(r["data"] for r in per_run[side])
        loop_phases[side] = {"phases_ms": medians, "shared_ms": shared, "data_ms": data_ms,
                             "loop_ms": sum(medians.values()) - data_ms, "shared_total_ms": sum(shared.values())}
    loop_phases["lightning_minus_plain_loop_ms"] = loop_phases["lightning"]["loop_ms"] - loop_phases["plain"]["loop_ms"]
    loop_phases["table"] = render_phases(loop_phases)
    diff = lambda key: bc.stats([lt[key] - p[key] for p, lt in zip(per_run["plain"], per_run["lightning"])])
    ms = {side: {k: bc.stats(rs, k) for k in rs[0]} for side, rs in per_run.items()}
    return {"config": asdict(cfg), "ms_per_batch": ms, "lightning_minus_plain_loop_ms": diff("loop"),
            "lightning_minus_plain_loop_mean_ms": diff("loop (mean)")}, loop_phases


def render(results: list[dict[str, Any]], compiled: bool = False) -> str:
    """The port-overhead table, or (``compiled``) the compile one: a row per result of :func:`versus`."""
    sides, key = (("eager", "compiled"), "speedup") if compiled else (("plain", "lightning"), "ratio")
    names = ("eager", "--model.compile true", "compiled ÷ eager") if compiled else ("plain", "port", "port ÷ plain")
    rows = []
    for r in results:
        c = r["config"]
        target = (f"{r['compile_s_estimate']:.0f}" if compiled
                  else f"≥ {r['target_ratio']}: {bc.yes(r['target_met'])}")
        shape = f"{c['batch_size']}x{c['max_seq_len']}, acc {c['accumulate']}"
        rows.append([c["name"], f"{r['params'] / 1e6:.1f}M", f"{shape}, {c['warmup_batches']}+{c['timed_batches']}",
                     *(bc.spread(r[f"{side}_tokens_per_s"], fmt=bc.fmt_num) for side in sides),
                     f"**{bc.spread(r[key])}**", bc.spread(r[f"cpu_{key}"]), target,
                     f"{r['max_abs_last_loss_diff']:.1e}"])
    return bc.table(["config", "params", "batch, accumulation, warm-up + timed micro-batches",
                     *(f"{n} tok/s med (min–max)" for n in names[:2]), f"{names[2]} med (min–max)",
                     "CPU-time ratio", "cold compile s" if compiled else "target", "Δ last loss"], rows)


def render_attribution(at: dict[str, Any]) -> str:
    names = {"batch": "whole micro-batch", "data": "data (the same loader, alone)", "step": "clip + AdamW update",
             "loop": "loop = whole − (data + forward + backward + clip + AdamW)"}
    p, lt = at["ms_per_batch"]["plain"], at["ms_per_batch"]["lightning"]
    rows = [[names.get(k, k), f"{p[k]['median']:.3f}", bc.spread(lt[k])] for k in ("batch", "data", *SHARED, "loop")]
    rows.append(["**port overhead = port loop − plain loop**", "",
                 f"**{bc.spread(at['lightning_minus_plain_loop_ms'])}**"])
    return bc.table([f"ms per micro-batch, {at['config']['name']} (median)", "plain", "port med (min–max over runs)"],
                    rows)


def render_phases(result: dict[str, Any]) -> str:
    rows = [[side, phase, f"{ms:.3f}"] for side in ("plain", "lightning")
            for phase, ms in result[side]["phases_ms"].items() if ms >= 0.005]
    rows += [[side, "**loop ms (the phases above minus the data alone)**", f"**{result[side]['loop_ms']:.3f}**"]
             for side in ("plain", "lightning")]
    rows.append(["", "**port − plain**", f"**{result['lightning_minus_plain_loop_ms']:+.3f}**"])
    return bc.table(["side", "phase (between consecutive stamps; medians)", "ms per micro-batch"], rows)


def plot(p: dict[str, Any], path: Path) -> Path:
    results, ms = p["results"], p["attribution"]["ms_per_batch"]
    tokens = [(f"{r['config']['name']}: {label}", r[f"{side}_tokens_per_s"], color) for r in results
              for side, label, color in (("plain", "plain", "tab:gray"), ("lightning", "port", "tab:purple"))]
    ratios = [(r["config"]["name"], r["ratio"], "tab:purple") for r in results]
    parts = [(label, {k: max(0.0, ms[side][k]["median"]) for k in ("data", *SHARED, "loop")}, 0.0)
             for side, label in (("plain", "plain"), ("lightning", "port"))]
    return bc.chart(path, ("training throughput", "tokens/s (median, min–max)", tokens),
                    ("port overhead", f"port ÷ plain per repetition (target ≥ {TARGET_RATIO})", ratios),
                    (f"a micro-batch, {p['attribution']['config']['name']}", "ms (medians)", parts), width=14)


def run(quick: bool = False, reps: int | None = None, no_compile: bool = False) -> dict[str, Any]:
    reps = reps or (2 if quick else 5)
    data, tok = bc.default_data()
    results = [measure(cfg, data, tok, reps, quick) for cfg in (QUICK_CONFIGS if quick else FULL_CONFIGS)]
    comp = compile_measure(COMPILE, data, tok, min(reps, 3)) if not (quick or no_compile) else None
    at, loop_phases = attribution(QUICK_ATTRIBUTION if quick else ATTRIBUTION, data, tok, reps, quick)
    overhead, mean = at["lightning_minus_plain_loop_ms"]["median"], at["lightning_minus_plain_loop_mean_ms"]["median"]
    met = overhead <= TARGET_LOOP_OVERHEAD_MS
    return {"reps": reps, "data": bc.rel(data), "tokenizer": bc.rel(tok), "results": results, "table": render(results),
            "attribution": at, "attribution_table": render_attribution(at), "loop_overhead_ms": overhead,
            "loop_overhead_mean_ms": mean, "loop_overhead_target_ms": TARGET_LOOP_OVERHEAD_MS,
            "loop_overhead_target_met": met,
            "loop_overhead_verdict": f"The port's loop overhead: **{overhead:+.3f} ms** per micro-batch (by the mean "
                                     f"over batches, which also counts the work done once per `log_interval`: "
                                     f"{mean:+.3f} ms); target ≤ {TARGET_LOOP_OVERHEAD_MS} ms: {bc.yes(met)}.",
            "loop_phases_table": loop_phases["table"], "also_written": {"loop_phases": loop_phases},
            "compile": comp or {"skipped": "--quick" if quick else "--no-compile"},
            "compile_table": render([comp], compiled=True) if comp else ""}


if __name__ == "__main__":
    from benchmarks.run_all import main
    raise SystemExit(main(alone=NAME))
