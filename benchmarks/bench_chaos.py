"""Goodput under chaos: what share of the machine's time a run keeps when it is killed again and again.

The embedded default (128x2, batch 16, seq 128, ``--epochs`` epochs of the embedded corpus) runs with
``--ckpt_path last`` on every start and ``--resume.save_every_minutes auto``; it is hit at exponentially distributed
wall-clock moments (mean 15, 30, 60, 120 s; start-up included; 70 % SIGKILL, 30 % SIGTERM, to the process group;
seeded: every run at one mean gets the same schedule) and restarted at once, until it finishes. Per mean: goodput (the
uninterrupted run's wall ÷ the chaos run's), restart cost (a signal -> the next optimizer step of a new start, p50 /
p95), micro-steps trained twice per SIGKILL, the loop's blocking seconds per save (the run's own record in its last
checkpoint), whether the final weights equal the uninterrupted run's, starts that skipped a damaged checkpoint, and
the Young/Daly prediction ``1 - s/tau - (R + tau/2)/MTBF`` from the measured s, R, tau. Beside it, MiniMind's
``train_pretrain.py --from_resume 1`` (``--minimind-src``: a checkout at d65ef2c; ``--minimind-python``: a Python with
its requirements) on the same data, model and schedule, saving every as many steps as our auto interval's seconds;
and a sweep of fixed intervals (tau*/3, tau*, 3 tau*; ``--resume.save_every_minutes``) against the auto one.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks import common as bc

NAME = "chaos"
HIDDEN, LAYERS, SEQ, BATCH, LR = 128, 2, 128, 16, 0.002
KILL_SHARE = 0.7  # the rest SIGTERM
INTERVAL_RE = re.compile(r"save interval: every ([\d.e+-]+) s")
ARGS = [(["--epochs"], {"type": int, "default": None, "help": "epochs of the embedded corpus (default 6, --quick 1)"}),
        (["--intervals"], {"type": float, "nargs": "+", "default": None,
                           "help": "mean seconds between signals (default 15 30 60 120)"}),
        (["--minimind-src"], {"default": None, "dest": "mm_src", "help": "MiniMind checkout (or $MINIMIND_SRC)"}),
        (["--minimind-python"], {"default": None, "dest": "mm_python",
                                 "help": "a Python with MiniMind's requirements (or $MINIMIND_PYTHON)"}),
        (["--no-sweep"], {"action": "store_true", "dest": "no_sweep", "help": "no fixed-interval sweep"}),
        (["--jobs"], {"type": int, "default": 1, "help": "runs at once (each 1 torch thread; > 1 shares the cores)"}),
        (["--seed"], {"type": int, "default": 0, "help": "the signal schedules' seed"})]


def schedule(mean: float, seed: int, horizon: float) -> list[tuple[float, int]]:
    """Signal moments (seconds after the run's first launch) and kinds: exponential gaps of mean ``mean``."""
    rng, t, out = random.Random(f"{seed}:{mean}"), 0.0, []
    while t < horizon:
        t += rng.expovariate(1 / mean)
        out.append((t, int(signal.SIGKILL if rng.random() < KILL_SHARE else signal.SIGTERM)))
    return out


def step_index(line: str) -> tuple[int, bool] | None:
    """A console line's micro-step counted over epochs, and whether it is the run's last."""
    if not (m := bc.CONSOLE_LINE_RE.search(line)):
        return None
    epoch, epochs, step, iters = map(int, m.group(1, 2, 3, 4))
    return (epoch - 1) * iters + step, epoch == epochs and step == iters


def chaos(cmd: list[str], work: Path, env: dict[str, str], signals: list[tuple[float, int]],
          limit: float) -> dict[str, Any]:
    """Run ``cmd`` again and again (the same command: it resumes) while ``signals`` hit it, until it finishes."""
    t0, pending, starts = time.monotonic(), list(signals), []
    while True:
        at = time.monotonic() - t0
        if at > limit:
            raise RuntimeError(f"{cmd[1]} ... in {work}: not finished after {limit:.0f} s and {len(starts)} starts")
        due = pending.pop(0) if pending else None
        r = bc.launch(cmd, work, env=env, timeout=limit, check=False,
                      signal_at=(due[0] - at, due[1]) if due else None)
        steps = [(at + t, *found) for t, line in r["lines"] if (found := step_index(line))]
        start = {"at": at, "wall_s": r["wall_s"], "returncode": r["returncode"], "steps": [s[:2] for s in steps],
                 "signal": signal.Signals(due[1]).name if due and r["signalled_s"] is not None else None,
                 "signal_at": at + r["signalled_s"] if r["signalled_s"] is not None else None,
                 "skipped_checkpoints": sum("skipping checkpoint" in line for _, line in r["lines"]),
                 "intervals": [float(m[1]) for _, line in r["lines"] if (m := INTERVAL_RE.search(line))]}
        starts.append(start)
        finished = any(last for *_, last in steps)
        if r["returncode"] == 0 and (start["signal"] is None or finished):
            return {"wall_s": time.monotonic() - t0, "starts": starts}
        if start["signal"] is None:  # it stopped by itself before the end: the benchmark's subject is broken
            raise RuntimeError(f"{cmd[1]} ... exit {r['returncode']} unsignalled in {work}:\n" + bc.tail(r["lines"]))
        if due is None:
            raise RuntimeError(f"{work}: the signal schedule ran out")


def summarize(run: dict[str, Any], baseline_s: float, mean: float, save_s: float | None,
              tau: float | None) -> dict[str, Any]:
    """Goodput, restart costs, redone micro-steps per signal kind, the Young/Daly prediction."""
    starts, restarts, redone, high = run["starts"], [], {"SIGKILL": [], "SIGTERM": []}, 0
    for i, s in enumerate(starts):
        if s["signal_at"] is not None:  # the next optimizer step of any later start
            nxt = next((t for later in starts[i + 1:] for t, _ in later["steps"][:1]), None)
            if nxt is not None:
                restarts.append(nxt - s["signal_at"])
        if i and s["steps"] and (kind := starts[i - 1]["signal"]):
            redone[kind].append(max(0, high - (s["steps"][0][1] - 1)))
        high = max([high, *(idx for _, idx in s["steps"])])
    kills = sum(s["signal"] == "SIGKILL" for s in starts)
    r = bc.stats(restarts) if restarts else None
    pct = lambda q: sorted(restarts)[min(len(restarts) - 1, int(q * len(restarts)))] if restarts else None
    predicted = (1 - save_s / tau - (r["median"] + tau / 2) / mean) if r and save_s is not None and tau else None
    return {"goodput": baseline_s / run["wall_s"], "wall_s": run["wall_s"], "starts": len(starts),
            "signals": {k: sum(s["signal"] == k for s in starts) for k in redone},
            "restart_s": {"p50": r["median"] if r else None, "p95": pct(0.95), "n": len(restarts)},
            "redone_per_kill": sum(redone["SIGKILL"]) / kills if kills else None,
            "redone_after_term": sum(redone["SIGTERM"]),
            "skipped_checkpoints": sum(s["skipped_checkpoints"] for s in starts),
            "save_s": save_s, "tau_s": tau, "young_daly": predicted}


def final_weights(work: Path) -> dict[str, Any]:
    import torch

    return torch.load(work / "out" / f"pretrain_{HIDDEN}.pth", map_location="cpu", weights_only=True)


def compare(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    diff = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
    return {"equal": a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a), "max_abs_diff": diff}


def ours_cmd(work: Path, epochs: int, every: float | None) -> tuple[list[str], dict[str, str], Path]:
    """``python -m lit_minimind.fit`` on the embedded default, every start ``--ckpt_path last``, a save every ``every``
    seconds (None: ``auto``): the command, its environment, where it runs."""
    data, tok = bc.default_data()
    flags = {"model.learning_rate": LR, "log_interval": 1, "trainer.max_epochs": epochs,
             "resume.save_every_minutes": "auto" if every is None else every / 60}
    return bc.fit_cmd(work, data, tok, (HIDDEN, LAYERS, SEQ, BATCH), flags, "--ckpt_path", "last"), bc.child_env(), work


def ours_save_s(work: Path) -> float | None:
    """The median blocking save cost the run recorded (its auto interval's ``s``), from its newest checkpoint."""
    import torch

    from lit_minimind.checkpoint.names import RESUME_STATE_KEY

    newest = max((work / "checkpoints").glob("*.ckpt"), key=os.path.getmtime)
    costs = torch.load(newest, map_location="cpu", weights_only=False)["callbacks"][RESUME_STATE_KEY]["schedule"]
    return statistics.median(costs["save_seconds"]) if costs["save_seconds"] else None


def minimind_cmd(mm: tuple[Path, str], work: Path, epochs: int, every_steps: int) -> tuple[list[str], dict, Path]:
    """MiniMind's ``trainer/train_pretrain.py --from_resume 1`` (checkout, Python) copied into ``work``, on the same
    data, tokenizer and model, fp32 on CPU, a save every ``every_steps``."""
    data, tok = bc.default_data()
    for part in ("model", "dataset", "trainer"):
        shutil.copytree(mm[0] / part, work / part, dirs_exist_ok=True)
    for f in tok.iterdir():  # the same tokenizer as ours
        shutil.copy(f, work / "model" / f.name)
    args = {"epochs": epochs, "batch_size": BATCH, "learning_rate": LR, "num_workers": 0, "accumulation_steps": 1,
            "grad_clip": 1.0, "log_interval": 1, "save_interval": every_steps, "hidden_size": HIDDEN,
            "num_hidden_layers": LAYERS, "max_seq_len": SEQ, "device": "cpu", "data_path": data, "from_resume": 1,
            "save_dir": "../out"}
    cmd = [mm[1], "train_pretrain.py", *(a for k, v in args.items() for a in (f"--{k}", str(v)))]
    return cmd, bc.child_env(HF_DATASETS_CACHE=str(work / "hf-datasets")), work / "trainer"


def minimind_save_s(run: dict[str, Any], every_steps: int) -> float | None:
    """Its save is in the loop: the gap after a saving step minus the median gap between steps."""
    steps = [s for start in run["starts"] for s in start["steps"]]
    gaps = {b[1]: b[0] - a[0] for a, b in zip(steps, steps[1:]) if b[1] == a[1] + 1}
    after = [gaps[i + 1] for i in gaps if i % every_steps == 0 and i + 1 in gaps]
    return max(0.0, statistics.median(after) - statistics.median(gaps.values())) if after else None


def measure(tmp: Path, epochs: int, means: list[float], mm: tuple[Path, str] | None, sweep: bool, jobs: int,
            seed: int) -> dict[str, Any]:
    limit = 3600.0  # a chaos run's wall-clock bound: 25 x its uninterrupted run's, once that is known

    def once(label: str, signals: list[tuple[float, int]], every: float | None = None,
             steps: int | None = None) -> dict[str, Any]:
        """Ours (a save every ``every`` s, None: auto) or, with ``steps``, MiniMind's, under ``signals``."""
        cmd, env, work = minimind_cmd(mm, tmp / label, epochs, steps) if steps else ours_cmd(tmp / label, epochs, every)
        bc.say(f"  {label}: starting")
        run = chaos(cmd, work, env, signals, limit=limit)
        bc.say(f"  {label}: {run['wall_s']:.1f} s, {len(run['starts'])} start(s)")
        return {**run, "work": tmp / label}

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        base = {"ours": pool.submit(once, "ours-uninterrupted", [])}
        if mm:
            base["minimind"] = pool.submit(once, "minimind-uninterrupted", [], steps=10)
        base = {k: f.result() for k, f in base.items()}
        save_s = ours_save_s(base["ours"]["work"])
        steps = [s for start in base["ours"]["starts"] for s in start["steps"]]
        step_s = (steps[-1][0] - steps[0][0]) / max(1, len(steps) - 1)
        horizon = 20 * base["ours"]["wall_s"]
        limit = 25 * max(b["wall_s"] for b in base.values())

        def per_mean(mean: float) -> dict[str, Any]:
            signals = schedule(mean, seed, horizon)
            auto = once(f"ours-auto-{mean:g}", signals)
            tau = sorted(t for s in auto["starts"] for t in s["intervals"])
            tau = tau[len(tau) // 2] if tau else None
            out = {"auto": summarize(auto, base["ours"]["wall_s"], mean, ours_save_s(auto["work"]), tau)}
            out["auto"]["weights"] = compare(final_weights(auto["work"]), final_weights(base["ours"]["work"]))
            if mm:
                every = max(1, round((tau or 10.0) / step_s))
                run = once(f"minimind-{mean:g}", signals, steps=every)
                weights = compare(final_weights(run["work"]), final_weights(base["minimind"]["work"]))
                out["minimind"] = {**summarize(run, base["minimind"]["wall_s"], mean, minimind_save_s(run, every),
                                             every * step_s), "save_interval_steps": every, "weights": weights}
            return out

        def fixed(mean: float, tau: float) -> dict[str, Any]:
            run = once(f"ours-fixed-{mean:g}-{tau:.3g}", schedule(mean, seed, horizon), tau)
            return {**summarize(run, base["ours"]["wall_s"], mean, ours_save_s(run["work"]), tau), "tau_s": tau}

        from lit_minimind.callbacks.schedule import young_daly_interval

        taus = {m: [young_daly_interval(save_s or 0.0, m) * f for f in (1 / 3, 1, 3)] for m in means} if sweep else {}
        by_mean = {m: pool.submit(per_mean, m) for m in means}
        swept = {m: [pool.submit(fixed, m, t) for t in ts] for m, ts in taus.items()}
        results = {f"{m:g}": f.result() for m, f in by_mean.items()}  # JSON keys: "15", "30", ...
        for m, runs in swept.items():
            results[f"{m:g}"]["sweep"] = [f.result() for f in runs]
    return {"baseline_s": {k: b["wall_s"] for k, b in base.items()}, "baseline_save_s": save_s, "step_s": step_s,
            "by_mean": results}


def render(p: dict[str, Any]) -> tuple[str, str]:
    f = lambda x, d=2: "–" if x is None else f"{x:.{d}f}"
    rows, sweep_rows = [], []
    for mean, r in p["by_mean"].items():
        for side, key in (("lit-minimind (auto)", "auto"), ("MiniMind", "minimind")):
            if (x := r.get(key)) is None:
                continue
            rows.append([mean, side, f"**{x['goodput']:.3f}**", f(x["young_daly"], 3), x["starts"],
                         f"{x['signals']['SIGKILL']} / {x['signals']['SIGTERM']}",
                         f"{f(x['restart_s']['p50'])} / {f(x['restart_s']['p95'])}", f(x["redone_per_kill"], 1),
                         x["redone_after_term"], f(x["save_s"], 3), f(x["tau_s"]),
                         "yes" if x["weights"]["equal"] else f"no ({x['weights']['max_abs_diff']:.1e})",
                         x["skipped_checkpoints"]])
        if sweep := r.get("sweep"):
            gap = max(s["goodput"] for s in sweep) - r["auto"]["goodput"]
            sweep_rows.append([mean, ", ".join(f"{s['tau_s']:.2g} s: {s['goodput']:.3f}" for s in sweep),
                               f"{r['auto']['goodput']:.3f} (tau {f(r['auto']['tau_s'])} s)",
                               f"{gap:+.3f}: {bc.yes(gap <= 0.02)}"])
    table = bc.table(["mean s between signals", "run", "goodput", "Young/Daly", "starts", "SIGKILL / SIGTERM",
                      "restart s p50 / p95", "micro-steps redone per SIGKILL", "redone after SIGTERM",
                      "blocking s per save", "interval s", "final weights = uninterrupted", "damaged skipped"], rows)
    sweep = bc.table(["mean s between signals", "fixed interval: goodput", "auto", "best fixed − auto (≤ 0.02)"],
                     sweep_rows) if sweep_rows else ""
    return table, sweep


def plot(p: dict[str, Any], path: Path) -> Path:
    rows = [(f"{side} @ {mean} s", r[key]["goodput"], color) for mean, r in p["by_mean"].items()
            for side, key, color in (("ours", "auto", "tab:orange"), ("MiniMind", "minimind", "tab:gray")) if key in r]
    return bc.chart(path, ("goodput under random SIGKILL / SIGTERM", "uninterrupted wall ÷ chaos wall", rows), width=7)


def run(quick: bool = False, reps: int | None = None, epochs: int | None = None, intervals: list[float] | None = None,
        mm_src: str | None = None, mm_python: str | None = None, no_sweep: bool = False, jobs: int = 1,
        seed: int = 0) -> dict[str, Any]:
    epochs = epochs or (1 if quick else 6)
    means = intervals or ([10.0] if quick else [15.0, 30.0, 60.0, 120.0])
    src, mm = mm_src or os.environ.get("MINIMIND_SRC"), None
    if not src or not (Path(src) / "trainer" / "train_pretrain.py").is_file():
        mm_note = "no MiniMind checkout (--minimind-src, $MINIMIND_SRC): its column is left out"
    elif python := bc.python_with("transformers, datasets, torch", mm_python, os.environ.get("MINIMIND_PYTHON"),
                                  sys.executable):
        mm, mm_note = (Path(src), python), f"MiniMind from {bc.rel(src)}"
    else:
        mm_note = "no Python with transformers/datasets (--minimind-python): MiniMind's column is left out"
    with bc.workdir("chaos") as tmp:
        measured = measure(tmp, epochs, means, mm, not (no_sweep or quick), jobs, seed)
    table, sweep = render(measured)
    at30 = measured["by_mean"].get("30", {}).get("auto")
    verdict = (f"{mm_note}. {jobs} run(s) at once. Uninterrupted: ours {measured['baseline_s']['ours']:.1f} s"
               + (f", MiniMind {measured['baseline_s']['minimind']:.1f} s" if "minimind" in measured["baseline_s"]
                  else "") + (f"; goodput at a 30 s mean: **{at30['goodput']:.3f}** (target ≥ 0.8: "
                              f"{bc.yes(at30['goodput'] >= 0.8)})" if at30 else "") + ".")
    return {"reps": 1, "epochs": epochs, "means_s": means, "seed": seed, "jobs": jobs, "kill_share": KILL_SHARE,
            "model": {"hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "max_seq_len": SEQ, "batch_size": BATCH},
            **measured, "table": table, "sweep_table": sweep, "verdict": verdict}


if __name__ == "__main__":
    from benchmarks.run_all import main
    raise SystemExit(main(alone=NAME))
