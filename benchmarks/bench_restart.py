"""Restart breakdown: where the seconds of a resume start go, process start -> first optimizer step.

A 64x2 model on the embedded corpus, and (not with ``--quick``) MiniMind's 768x8 on a seeded 1,270,238-record file
(its ``pretrain_t2t_mini.jsonl``; target: at most 1.5 s more than ``import torch, lightning``), trains 3 steps and
saves; each repetition (rotated) starts ``python -X importtime -m lit_minimind.fit --ckpt_path last``, killed at its
second console line: the gap between the two is a training step, which an uninterrupted run pays too, so the
restart's cost is launch -> first optimizer step less that step. Phases cut at lines it prints anyway, stamped as
read (the ``-X importtime`` lines of ``site`` and ``lit_minimind.cli.fit``, ``Seed set``, Lightning's ``Restoring
states`` / ``Restored all states``, the console line); the span before ``Restoring`` timed in parts alone in a fresh
process with the same public functions. Also: late imports per phase, ``import torch, lightning`` alone, the resume
without ``-X importtime``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from benchmarks import common as bc

NAME = "restart"
MAX_SEQ_LEN, BATCH_SIZE, TRAINED_STEPS = 64, 4, 3
SIZES = {"64x2": ((64, 2), None), "768x8": ((768, 8), 1_270_238)}  # (hidden, layers), records (None: embedded corpus)
MINIMIND_TARGET_S = 1.5  # at 768x8: a resume start at most this much longer than `import torch, lightning`
PHASES = [("interpreter start-up", "site"), ("imports (torch, Lightning, CLI)", "imports"), ("CLI parsing", "seed"),
          ("model + Trainer, checkpoint choice + read, data index, Lightning set-up", "restoring"),
          ("Lightning restore (+ its logger's hparams file)", "restored"), ("first optimizer step", "first_line")]
MARKERS = [("seed", "Seed set to"), ("restoring", "Restoring states from the checkpoint"),
           ("restored", "Restored all states from the checkpoint")]
KINDS = ["resume -X importtime", "resume", "import torch, lightning", "isolated parts", "exit"]
ISOLATED = f"""
import json, sys, time
from lit_minimind.resume.start import choose_checkpoint
from lit_minimind.data.datamodule import MiniMindDataModule
from lit_minimind.checkpoint.read import read_checkpoint
ckpt_dir, data, tok = sys.argv[1:4]
t0 = time.perf_counter()
path = choose_checkpoint("last", ckpt_dir, sys.argv[4], 0)
t1 = time.perf_counter()
read_checkpoint(path, "cpu")
t2 = time.perf_counter()
MiniMindDataModule(data_path=data, tokenizer_path=tok, max_seq_len={MAX_SEQ_LEN}, batch_size={BATCH_SIZE}).setup("fit")
print(json.dumps({{"checkpoint choice": t1 - t0, "checkpoint read": t2 - t1,
                  "data index (cached)": time.perf_counter() - t2}}))
"""


def parse_importtime(line: str) -> tuple[int, str, int] | None:
    """``import time: self | cumulative | name`` -> (cumulative us, name, depth), or None."""
    parts = line.split("|")
    if len(parts) != 3 or not line.startswith("import time:") or not parts[1].strip().isdigit():
        return None
    name = parts[2].rstrip("\n")
    return int(parts[1]), name.strip(), (len(name) - len(name.lstrip(" ")) - 1) // 2


def resume_start(cmd: list[str], work: Path, importtime: bool) -> dict[str, Any]:
    """One resume start, killed at its second console line: when each marker line was read, the top-level imports,
    the second step's seconds."""
    seen: list[str] = []
    until = lambda line: bool(bc.CONSOLE_LINE_RE.search(line)) and (seen.append(line) or len(seen) == 2)  # noqa: E731
    run = bc.launch(cmd[:1] + ["-X", "importtime"] * importtime + cmd[1:], work, until=until)
    events: dict[str, float] = {}
    imports, packages, step = [], {}, None
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
            events["second_line" if "first_line" in events else "first_line"] = t
            step = step or int(m[3])
        else:
            events.update({e: t for e, start in MARKERS if line.startswith(start) and e not in events})
    expected = ["first_line", "second_line", *(e for e, _ in MARKERS), *["site", "imports"] * importtime]
    if missing := [e for e in expected if e not in events]:
        raise RuntimeError(f"the resume start printed no {missing} line:\n" + bc.tail(run["lines"]))
    if step != TRAINED_STEPS + 1:
        raise RuntimeError(f"the resume's first console line is step {step}, expected {TRAINED_STEPS + 1}")
    return {"events": events, "imports": imports, "packages": packages}


def bounds(run: dict[str, Any]) -> list[tuple[str, float, float]]:
    ends = [run["events"][end] for _, end in PHASES]
    return [(label, start, end) for (label, _), start, end in zip(PHASES, [0.0, *ends], ends)]


def late_imports(run: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Top-level imports finished after the CLI's own, per phase: seconds (cumulative -X importtime), the largest."""
    out = {}
    for label, lo, hi in bounds(run)[2:]:
        inside = [(us / 1e6, name) for t, us, name in run["imports"] if lo < t <= hi]
        top = max(inside, default=(0.0, None))
        out[label] = {"seconds": sum(s for s, _ in inside), "count": len(inside), "largest": top[1],
                      "largest_s": top[0]}
    return out


def measure(reps: int, data: Path, tok: Path, work: Path, hidden: int, layers: int) -> dict[str, list[Any]]:
    shape, flags = (hidden, layers, MAX_SEQ_LEN, BATCH_SIZE), {"log_interval": 1}
    bc.launch(bc.fit_cmd(work, data, tok, shape, {**flags, "trainer.max_steps": TRAINED_STEPS,
                                                  "resume.save_interval": TRAINED_STEPS}), work)
    cmd = bc.fit_cmd(work, data, tok, shape, flags, "--ckpt_path", "last")  # killed before any save
    # nothing left to train: restores, prints its summary and ends (the exit phase: last line -> process gone)
    ended = bc.fit_cmd(work, data, tok, shape, {**flags, "trainer.max_steps": TRAINED_STEPS}, "--ckpt_path", "last")
    isolated = [sys.executable, "-c", ISOLATED, str(work / "checkpoints"), str(data), str(tok), f"pretrain_{hidden}"]

    def start(kind: str) -> dict[str, Any]:
        if kind.startswith("resume"):
            return resume_start(cmd, work, importtime=kind != "resume")
        if kind == "isolated parts":
            return json.loads(bc.launch(isolated, work)["lines"][-1][1])
        if kind == "exit":
            run = bc.launch(ended, work)
            return {"exit": run["wall_s"] - run["lines"][-1][0]}
        bare = bc.launch([sys.executable, "-X", "importtime", "-c", "import torch, lightning"], work)
        done = next(t for t, line in bare["lines"] if (parse_importtime(line) or ())[1:] == ("lightning", 0))
        return {"imported": done, "exit": bare["wall_s"]}

    note = lambda r: f"{r['events']['first_line']:.2f} s to the first optimizer step" if "events" in r else "done"
    return bc.rotated(KINDS, reps, start, note=note)


def breakdown(reps: int, size: str) -> dict[str, Any]:
    """The phases of a resume start of one model size, with the bare import beside them."""
    (hidden, layers), records = SIZES[size]
    data, tok = bc.default_data()
    if records:
        data = bc.synthetic_jsonl(records, 600, 1100)  # MiniMind's pretraining records, cached
    bc.say(f"  {size}: {bc.rel(data)}")
    with bc.workdir("restart") as tmp:
        runs = measure(reps, data, tok, tmp, hidden, layers)
    traced, parts = runs[KINDS[0]], runs["isolated parts"]
    by_phase = [dict((label, hi - lo) for label, lo, hi in bounds(r)) for r in traced]
    phases = {label: bc.stats(by_phase, label) for label, _ in PHASES}
    parts = {k: bc.stats(parts, k) for k in parts[0]}
    lates = [late_imports(r) for r in traced]
    late = {label: {**lates[0][label], **{k: bc.stats([x[label][k] for x in lates])["median"]
                                          for k in ("seconds", "largest_s")}} for label, _ in PHASES[2:]}
    total, plain = (bc.stats([r["events"]["first_line"] for r in runs[k]]) for k in KINDS[:2])
    steps = [r["events"]["second_line"] - r["events"]["first_line"] for r in runs["resume"]]
    step = bc.stats(steps)
    start = bc.stats([r["events"]["first_line"] - s for r, s in zip(runs["resume"], steps)])  # less one training step
    bare, bare_exit = (bc.stats(runs["import torch, lightning"], k) for k in ("imported", "exit"))
    exit_s = bc.stats(runs["exit"], "exit")
    top_imports = sorted(((bc.stats([r["packages"].get(n, 0) / 1e6 for r in traced])["median"], n)  # first imports
                          for n in traced[0]["packages"] if n != "lit_minimind"), reverse=True)[:8]
    cell = lambda s: bc.spread(s) if s["n"] > 1 else f"{s['median']:.3f}"
    share = lambda s: f"{s['median'] / total['median']:.0%}"
    rows = []
    for label, _ in PHASES:
        li = late.get(label)
        note = (f"{li['seconds']:.3f} s in {li['count']} late import(s), largest {li['largest']} "
                f"{li['largest_s']:.3f} s") if li and li["count"] else ""
        rows.append([label, cell(phases[label]), share(phases[label]), note])
        if label.startswith("model + Trainer"):
            rows += [[f"… of which {k} (isolated, fresh process)", cell(s), share(s), ""] for k, s in parts.items()]
    rows += [["**launch → first optimizer step** (with -X importtime)", cell(total), "100%", ""],
             ["the same resume without -X importtime", cell(plain), share(plain), ""],
             ["… its second optimizer step (a step an uninterrupted run pays too)", cell(step), share(step), ""],
             ["**resume start**: launch → first optimizer step, less that step", cell(start), share(start), ""],
             ['`python -X importtime -c "import torch, lightning"`: imports done', cell(bare), share(bare),
              "with matplotlib, which torchmetrics loads here; the CLI switches that off"],
             ["… and the process's exit", cell(bare_exit), share(bare_exit), ""],
             ["**exit**: a run's last line (its summary) → the process gone", cell(exit_s), share(exit_s),
              "a resume with nothing left to train"]]
    verdict = (f"A resume start of the {size} model reaches its first optimizer step {plain['median']:.2f} s after "
               f"launch; `import torch, lightning` alone takes {bare['median']:.2f} s, {share(bare)} of the resume "
               f"start's {total['median']:.2f} s with -X importtime. Largest packages' first imports (cumulative: a "
               "package's time includes what it imported first): "
               + ", ".join(f"{n} {s:.2f} s" for s, n in top_imports[:5]) + ".")
    return {"reps": reps, "model": {"hidden_size": hidden, "num_hidden_layers": layers}, "records": records,
            "max_seq_len": MAX_SEQ_LEN, "batch_size": BATCH_SIZE,
            "trained_steps": TRAINED_STEPS, "phases_s": phases, "isolated_parts_s": parts, "late_imports": late,
            "launch_to_first_step_s": total, "launch_to_first_step_plain_s": plain, "step_s": step,
            "resume_start_s": start, "import_torch_lightning_s": bare,
            "import_torch_lightning_exit_s": bare_exit, "exit_s": exit_s,
            "top_imports_s": [{"name": n, "cumulative_s": s} for s, n in top_imports],
            "table": bc.table(["phase", "s med (min–max)", "share", "late imports in it (-X importtime)"], rows),
            "verdict": verdict, "runs": {"events": [r["events"] for r in traced],
                                         "plain_events": [r["events"] for r in runs["resume"]]}}


def run(quick: bool = False, reps: int | None = None) -> dict[str, Any]:
    payload = breakdown(reps or (1 if quick else 5), "64x2")
    if quick:
        return payload
    big = breakdown(min(reps or 3, 3), "768x8")
    bare = big["import_torch_lightning_s"]["median"]
    extra = big["resume_start_s"]["median"] - bare
    met = "yes" if extra <= MINIMIND_TARGET_S else "NO"
    step, start = big["step_s"]["median"], big["resume_start_s"]["median"]
    verdict = (f"At MiniMind's size (768x8, {SIZES['768x8'][1]:,} records): a resume start (launch → first optimizer "
               f"step, less one step of {step:.2f} s) takes {start:.2f} s, "
               f"**{extra:+.2f} s** beyond `import torch, lightning` alone ({bare:.2f} s; target ≤ "
               f"{MINIMIND_TARGET_S} s: {met}). " + big["verdict"])
    return {**payload, "minimind_size": {k: v for k, v in big.items() if k not in ("table", "verdict")},
            "minimind_size_table": big["table"], "minimind_size_verdict": verdict, "minimind_size_extra_s": extra}


def plot(p: dict[str, Any], path: Path) -> Path:
    phases, parts = ({k: s["median"] for k, s in p[key].items()} for key in ("phases_s", "isolated_parts_s"))
    rows = [("resume start", phases, 0.0), ("isolated parts", parts, sum(list(phases.values())[:3]))]
    return bc.chart(path, ("restart breakdown: launch → first optimizer step", "seconds after launch (medians)",
                           rows))


if __name__ == "__main__":
    from benchmarks.run_all import main
    raise SystemExit(main(alone=NAME))
