"""Restart breakdown: where the seconds of a resume start go, process start -> first optimizer step.

A 64x2 model trains 3 steps and saves; each repetition starts ``python -X importtime -m lit_minimind.fit ...
--ckpt_path last`` and kills it at its first console line. Nothing is added to the process: phases are cut at lines
it prints anyway, stamped as read (the ``-X importtime`` lines of ``site`` and ``lit_minimind.cli.fit``, ``Seed set``,
Lightning's ``Restoring states`` / ``Restored all states``, the console line). The span before ``Restoring`` has no
line, so its parts are timed alone in a fresh process with the same public functions (``choose_checkpoint`` +
``read_start_checkpoint``, ``MiniMindDataModule.setup`` with the index cached). Also: late imports per phase,
``python -X importtime -c "import torch, lightning"`` and the resume without ``-X importtime``.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import common as bc

NAME = "restart"
MODEL, MAX_SEQ_LEN, BATCH_SIZE, TRAINED_STEPS, STEM = {"hidden_size": 64, "num_hidden_layers": 2}, 64, 4, 3, "pretrain_64"
PHASES = [("interpreter start-up", "site"), ("imports (torch, Lightning, CLI)", "imports"), ("CLI parsing", "seed"),
          ("model + Trainer, checkpoint choice + read, data index, Lightning set-up", "restoring"),
          ("Lightning restore (+ its logger's hparams file)", "restored"), ("first optimizer step", "first_line")]
MARKERS = [("seed", "Seed set to"), ("restoring", "Restoring states from the checkpoint"),
           ("restored", "Restored all states from the checkpoint")]
ISOLATED = f"""
import json, sys, time
from lit_minimind.callbacks.files import choose_checkpoint
from lit_minimind.data.datamodule import MiniMindDataModule
from lit_minimind.resume.io import read_start_checkpoint
ckpt_dir, data, tok = sys.argv[1:4]
t0 = time.perf_counter()
path = choose_checkpoint("last", ckpt_dir, "{STEM}", 0)
t1 = time.perf_counter()
read_start_checkpoint(path)
t2 = time.perf_counter()
MiniMindDataModule(data_path=data, tokenizer_path=tok, max_seq_len={MAX_SEQ_LEN}, batch_size={BATCH_SIZE}).setup("fit")
print(json.dumps({{"checkpoint choice": t1 - t0, "checkpoint read": t2 - t1, "data index (cached)": time.perf_counter() - t2}}))
"""


def parse_importtime(line: str) -> tuple[int, str, int] | None:
    """``import time: self | cumulative | name`` -> (cumulative us, name, depth), or None."""
    parts = line.split("|")
    if len(parts) != 3 or not line.startswith("import time:") or not parts[1].strip().isdigit():
        return None
    name = parts[2].rstrip("\n")
    return int(parts[1]), name.strip(), (len(name) - len(name.lstrip(" ")) - 1) // 2


def resume_start(cmd: list[str], work: Path, importtime: bool) -> dict[str, Any]:
    """One resume start, killed at its first console line: when each marker line was read, the top-level imports."""
    run = bc.launch(cmd[:1] + (["-X", "importtime"] if importtime else []) + cmd[1:], work, until=bc.CONSOLE_LINE_RE.search)
    events: dict[str, float] = {}
    imports, packages, first = [], {}, {}
    for t, line in run["lines"]:
        if (parsed := parse_importtime(line)) is not None:
            cumulative, name, depth = parsed
            if name in ("site", "lit_minimind.cli.fit"):
                events.setdefault("site" if name == "site" else "imports", t)
            if depth == 0:
                imports.append((t, cumulative, name))
            if "." not in name:
                packages.setdefault(name, cumulative)
        elif m := bc.CONSOLE_LINE_RE.search(line):
            events["first_line"], first = t, {"epoch": int(m[1]), "step": int(m[3]), "iters": int(m[4])}
        else:
            events.update({e: t for e, start in MARKERS if line.startswith(start) and e not in events})
    missing = [e for e in ["first_line", *(e for e, _ in MARKERS), *(["site", "imports"] if importtime else [])] if e not in events]
    if missing:
        raise RuntimeError(f"the resume start printed no {missing} line:\n" + "".join(line for _, line in run["lines"][-30:]))
    return {"events": events, "first": first, "imports": imports, "packages": packages}


def bounds(run: dict[str, Any]) -> list[tuple[str, float, float]]:
    out, start = [], 0.0
    for label, end in PHASES:
        out.append((label, start, run["events"][end]))
        start = run["events"][end]
    return out


def late_imports(run: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Top-level imports finished after the CLI's own, per phase: seconds (cumulative -X importtime), the largest."""
    out = {}
    for label, lo, hi in bounds(run)[2:]:
        inside = [(us / 1e6, name) for t, us, name in run["imports"] if lo < t <= hi]
        top = max(inside, default=(0.0, None))
        out[label] = {"seconds": sum(s for s, _ in inside), "count": len(inside), "largest": top[1], "largest_s": top[0]}
    return out


def run(quick: bool = False, reps: int | None = None) -> dict[str, Any]:
    reps = reps or (1 if quick else 5)
    data, tok = bc.default_data()
    work = Path(tempfile.mkdtemp(prefix="bench-restart-", dir=bc.cache_dir()))
    flags = {"model.hidden_size": MODEL["hidden_size"], "model.num_hidden_layers": MODEL["num_hidden_layers"],
             "data.max_seq_len": MAX_SEQ_LEN, "data.batch_size": BATCH_SIZE, "log_interval": 1}
    try:
        bc.launch(bc.fit_cmd(work, data, tok, {**flags, "trainer.max_steps": TRAINED_STEPS, "resume.save_interval": TRAINED_STEPS}), work)
        cmd = bc.fit_cmd(work, data, tok, flags, "--ckpt_path", "last")  # killed before any save
        kinds = ["resume -X importtime", "resume", "import torch, lightning", "isolated parts"]
        runs: dict[str, list[Any]] = {k: [] for k in kinds}
        for rep in range(reps):
            for kind in bc.alternating(kinds, rep):
                if kind.startswith("resume"):
                    r = resume_start(cmd, work, importtime=kind != "resume")
                    if r["first"]["step"] != TRAINED_STEPS + 1:
                        raise RuntimeError(f"the resume's first console line is step {r['first']['step']}, expected {TRAINED_STEPS + 1}")
                elif kind == "isolated parts":
                    r = json.loads(bc.launch([sys.executable, "-c", ISOLATED, str(work / "checkpoints"), str(data), str(tok)],
                                          work)["lines"][-1][1])
                else:
                    bare = bc.launch([sys.executable, "-X", "importtime", "-c", "import torch, lightning"], work)
                    done = [t for t, line in bare["lines"] if (p := parse_importtime(line)) and p[1] == "lightning" and p[2] == 0]
                    r = {"imported": done[0], "exit": bare["wall_s"]}
                runs[kind].append(r)
            bc.say(f"  rep {rep + 1}/{reps}: {runs['resume -X importtime'][-1]['events']['first_line']:.2f} s to the first optimizer "
                f"step (-X importtime), {runs['resume'][-1]['events']['first_line']:.2f} s without")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    traced = runs["resume -X importtime"]
    phases = {label: bc.stats([hi - lo for r in traced for lab, lo, hi in bounds(r) if lab == label]) for label, _ in PHASES}
    parts = {k: bc.stats([r[k] for r in runs["isolated parts"]]) for k in runs["isolated parts"][0]}
    late = {label: {**late_imports(traced[0])[label], **{k: bc.stats([late_imports(r)[label][k] for r in traced])["median"]
                                                        for k in ("seconds", "largest_s")}} for label, _ in PHASES[2:]}
    total = bc.stats([r["events"]["first_line"] for r in traced])
    plain = bc.stats([r["events"]["first_line"] for r in runs["resume"]])
    bare = bc.stats([r["imported"] for r in runs["import torch, lightning"]])
    bare_exit = bc.stats([r["exit"] for r in runs["import torch, lightning"]])
    top_imports = sorted(((bc.stats([r["packages"].get(n, 0) / 1e6 for r in traced])["median"], n)  # each package's first import
                          for n in traced[0]["packages"] if n != "lit_minimind"), reverse=True)[:8]
    cell = lambda s: f"{s['median']:.3f}" + (f" ({s['min']:.3f}–{s['max']:.3f})" if s["n"] > 1 else "")
    share = lambda s: f"{s['median'] / total['median']:.0%}"
    rows = []
    for label, _ in PHASES:
        li = late.get(label)
        note = f"{li['seconds']:.3f} s in {li['count']} late import(s), largest {li['largest']} {li['largest_s']:.3f} s" if li and li["count"] else ""
        rows.append([label, cell(phases[label]), share(phases[label]), note])
        if label.startswith("model + Trainer"):
            rows += [[f"… of which {part} (isolated, fresh process)", cell(s), share(s), ""] for part, s in parts.items()]
    rows += [["**launch → first optimizer step** (with -X importtime)", cell(total), "100%", ""],
             ["the same resume without -X importtime", cell(plain), share(plain), ""],
             ['`python -X importtime -c "import torch, lightning"`: imports done', cell(bare), share(bare),
              "with matplotlib, which torchmetrics loads here; the CLI switches that off"],
             ["… and the process's exit", cell(bare_exit), share(bare_exit), ""]]
    verdict = (f"A resume start of the tiny model reaches its first optimizer step {plain['median']:.2f} s after launch; "
               f"`import torch, lightning` alone takes {bare['median']:.2f} s, {share(bare)} of the resume start's "
               f"{total['median']:.2f} s with -X importtime. Largest packages' first imports (cumulative: a package's time "
               "includes what it imported first): " + ", ".join(f"{name} {s:.2f} s" for s, name in top_imports[:5]) + ".")
    return {"reps": reps, "model": MODEL, "max_seq_len": MAX_SEQ_LEN, "batch_size": BATCH_SIZE, "trained_steps": TRAINED_STEPS,
            "phases_s": phases, "isolated_parts_s": parts, "late_imports": late, "launch_to_first_step_s": total,
            "launch_to_first_step_plain_s": plain, "import_torch_lightning_s": bare, "import_torch_lightning_exit_s": bare_exit,
            "top_imports_s": [{"name": n, "cumulative_s": s} for s, n in top_imports],
            "table": bc.table(["phase", "s med (min–max)", "share", "late imports in it (-X importtime)"], rows), "verdict": verdict,
            "runs": {"events": [r["events"] for r in traced], "plain_events": [r["events"] for r in runs["resume"]]}}


def plot(p: dict[str, Any], path: Path) -> Path:
    plt, phases, parts = bc.pyplot(), p["phases_s"], p["isolated_parts_s"]
    fig, ax = plt.subplots(figsize=(9, 2.8))
    left = 0.0
    for label, s in phases.items():
        ax.barh(["resume start"], [s["median"]], left=left, label=label)
        left += s["median"]
    left = sum(s["median"] for s in list(phases.values())[:3])
    for label, s in parts.items():
        ax.barh(["isolated parts"], [s["median"]], left=left, label=label, hatch="//")
        left += s["median"]
    ax.set(xlabel="seconds after launch (medians)", title="restart breakdown: launch → first optimizer step")
    ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return bc.save_figure(fig, path)


if __name__ == "__main__":
    raise SystemExit(bc.bench_main(sys.modules[__name__]))
