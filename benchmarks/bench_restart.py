"""Restart breakdown: where the seconds of a resume start go, process start -> first optimizer step.

A tiny model (64x2, seq 64, batch 4, accumulation 1) trains 3 steps on the embedded corpus and saves;
then, in every repetition, ``python -X importtime -m lit_minimind.fit ... --ckpt_path last`` resumes from
that checkpoint and is killed at its first console line (printed after the first batch: with
accumulation 1, the first optimizer step). Nothing in the product is patched: the phases are cut at
lines the process prints anyway, each stamped with this benchmark's ``time.monotonic()`` as it is read
(both pipes read as the lines come):

* the ``-X importtime`` line of ``site`` (interpreter initialised) and of ``lit_minimind.cli.fit`` (its
  imports done: torch, Lightning, jsonargparse, the CLI);
* ``Seed set to 42`` (LightningCLI parsed and checked the command line);
* ``Restoring states from the checkpoint path at ...`` (Lightning's; before it: the model, Trainer and
  DataModule built, the checkpoint chosen and read once, the data index opened, Lightning's set-up);
* ``Restored all states from the checkpoint at ...`` (Lightning's restore of modules, loops, optimizer);
* the first MiniMind console line.

The span before ``Restoring`` has no printed line inside it, so its two parts of interest are timed in
isolation, each in a fresh process after its imports, calling the same functions: the checkpoint choice
and read (``choose_checkpoint`` + ``read_start_checkpoint``) and the data index (``MiniMindDataModule.setup``
with the index cached, as a resume finds it). Late imports (``-X importtime`` lines after the CLI's own
imports) are summed per phase. For comparison, the same repetition also times ``python -X importtime -c "import torch,
lightning"`` (to ``lightning``'s import line, and to its exit) and the same resume without ``-X importtime``
(the instrumentation's cost).

``python -m benchmarks.bench_restart [--quick] [--reps N]``
"""

from __future__ import annotations

import json
import os
import selectors
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
    save_figure,
    say,
    set_threads,
    stats,
    table,
    write_json,
)

FULL = {"reps": 5}
QUICK = {"reps": 1}
MODEL = {"hidden_size": 64, "num_hidden_layers": 2}
MAX_SEQ_LEN, BATCH_SIZE, TRAINED_STEPS = 64, 4, 3
STEM = "pretrain_64"
# (label, the event that ends it); each phase starts where the previous one ended, the first at launch
PHASES = [
    ("interpreter start-up", "site"),
    ("imports (torch, Lightning, CLI)", "imports"),
    ("CLI parsing", "seed"),
    ("model + Trainer, checkpoint choice + read, data index, Lightning set-up", "restoring"),
    ("Lightning restore (+ its logger's hparams file)", "restored"),
    ("first optimizer step", "first_line"),
]
MARKERS = [  # (event, the line's start; the first line matching counts)
    ("seed", "Seed set to"),
    ("restoring", "Restoring states from the checkpoint"),
    ("restored", "Restored all states from the checkpoint"),
]
# one fresh process per part: its imports first (not timed), then the part, printed as one JSON line
ISOLATED = r"""
import json, sys, time
from lit_minimind.callbacks.files import choose_checkpoint
from lit_minimind.data.datamodule import MiniMindDataModule
from lit_minimind.resume.io import read_start_checkpoint
ckpt_dir, data, tok = sys.argv[1:4]
t0 = time.perf_counter()
path = choose_checkpoint("last", ckpt_dir, "{stem}", 0)
t1 = time.perf_counter()
read_start_checkpoint(path)
t2 = time.perf_counter()
dm = MiniMindDataModule(data_path=data, tokenizer_path=tok, max_seq_len={seq}, batch_size={batch})
dm.setup("fit")
t3 = time.perf_counter()
print(json.dumps({{"checkpoint choice": t1 - t0, "checkpoint read": t2 - t1, "data index (cached)": t3 - t2}}))
""".format(stem=STEM, seq=MAX_SEQ_LEN, batch=BATCH_SIZE)


def env() -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("LIT_MINIMIND_TEST")}
    e.update({"PYTHONPATH": str(ROOT), "LIT_MINIMIND_CACHE": str(cache_dir()), "PYTHONUNBUFFERED": "1",
              "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled"})
    return e


def cli_args(data: Path, tok: Path, work: Path) -> list[str]:
    return [
        "--model.hidden_size", str(MODEL["hidden_size"]), "--model.num_hidden_layers", str(MODEL["num_hidden_layers"]),
        "--data.data_path", str(data), "--data.tokenizer_path", str(tok),
        "--data.max_seq_len", str(MAX_SEQ_LEN), "--data.batch_size", str(BATCH_SIZE),
        "--trainer.accumulate_grad_batches", "1", "--trainer.max_epochs", "1",
        "--trainer.accelerator", "cpu", "--trainer.devices", "1",
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
        "--log_interval", "1", "--resume.out_dir", str(work / "out"), "--resume.ckpt_dir", str(work / "checkpoints"),
    ]


def parse_importtime(line: str) -> tuple[int, str, int] | None:
    """``import time: self | cumulative | name`` -> (cumulative us, name, depth), or None."""
    parts = line.split("|")
    if len(parts) != 3 or not line.startswith("import time:"):
        return None
    try:
        cumulative = int(parts[1])
    except ValueError:  # the header line
        return None
    name = parts[2].rstrip("\n")
    depth = (len(name) - len(name.lstrip(" ")) - 1) // 2
    return cumulative, name.strip(), depth


def lines_as_read(proc: subprocess.Popen) -> Any:
    """``(time.monotonic(), line)`` of both pipes, each line stamped when its bytes arrive (unbuffered reads:
    a line never waits in a reader's buffer for the next one)."""
    sel = selectors.DefaultSelector()
    pending: dict[int, bytes] = {}
    for stream in (proc.stdout, proc.stderr):
        assert stream is not None
        sel.register(stream.fileno(), selectors.EVENT_READ)
        pending[stream.fileno()] = b""
    try:
        while pending:
            for key, _ in sel.select():
                fd = int(key.fd)
                chunk = os.read(fd, 1 << 16)
                now = time.monotonic()
                if not chunk:
                    sel.unregister(fd)
                    rest = pending.pop(fd)
                    if rest:
                        yield now, rest.decode(errors="replace")
                    continue
                *complete, pending[fd] = (pending[fd] + chunk).split(b"\n")
                for raw in complete:
                    yield now, raw.decode(errors="replace") + "\n"
    finally:
        sel.close()


def run_resume(args: list[str], work: Path, importtime: bool, timeout: float = 600) -> dict[str, Any]:
    """One resume start, killed at its first console line: the monotonic time of each marker line."""
    cmd = [sys.executable, *(["-X", "importtime"] if importtime else []), "-m", "lit_minimind.fit", *args]
    launch = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=work, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    watchdog = threading.Timer(timeout, lambda: os.killpg(proc.pid, signal.SIGKILL))
    watchdog.start()
    events: dict[str, float] = {"launch": launch}
    imports: list[tuple[float, int, str]] = []  # (when read, cumulative us, name) of top-level imports
    packages: dict[str, int] = {}  # each package's first import (at any depth): its cumulative us
    tail: list[str] = []
    first: dict[str, Any] = {}
    try:
        for now, line in lines_as_read(proc):
            parsed = parse_importtime(line)
            if parsed is not None:
                cumulative, name, depth = parsed
                if name == "site":
                    events.setdefault("site", now)
                elif name == "lit_minimind.cli.fit":
                    events.setdefault("imports", now)
                if depth == 0:
                    imports.append((now, cumulative, name))
                if "." not in name:
                    packages.setdefault(name, cumulative)
                continue
            tail = (tail + [line])[-40:]
            for event, start in MARKERS:
                if line.startswith(start):
                    events.setdefault(event, now)
            m = CONSOLE_LINE_RE.search(line)
            if m:
                events["first_line"] = now
                first = {"epoch": int(m[1]), "step": int(m[3]), "iters": int(m[4])}
                break
    finally:
        watchdog.cancel()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    wanted = ["first_line", *(e for e, _ in MARKERS)] + (["site", "imports"] if importtime else [])
    missing = [e for e in wanted if e not in events]
    if missing:
        raise RuntimeError(f"the resume start printed no {missing} line (exit {proc.returncode}):\n{''.join(tail)}")
    return {"events": {k: v - launch for k, v in events.items()}, "first": first,
            "imports": [(t - launch, us, name) for t, us, name in imports], "packages": packages}


def phases_of(run: dict[str, Any]) -> dict[str, float]:
    ev, out, start = run["events"], {}, 0.0
    for label, end in PHASES:
        out[label] = ev[end] - start
        start = ev[end]
    return out


def late_imports(run: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Top-level imports finished after the CLI's own imports, per phase: seconds (their cumulative
    -X importtime) and the largest."""
    ev, bounds, start = run["events"], [], 0.0
    for label, end in PHASES:
        bounds.append((label, start, ev[end]))
        start = ev[end]
    out: dict[str, dict[str, Any]] = {}
    for label, lo, hi in bounds[2:]:
        inside = [(us / 1e6, name) for t, us, name in run["imports"] if lo < t <= hi]
        top = max(inside, default=(0.0, None))
        out[label] = {"seconds": sum(s for s, _ in inside), "count": len(inside), "largest": top[1], "largest_s": top[0]}
    return out


def bare_import(work: Path) -> dict[str, float]:
    """``python -X importtime -c "import torch, lightning"``: seconds to the line of ``lightning``'s import
    (the imports done) and to the process's exit (its teardown included)."""
    launch = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-X", "importtime", "-c", "import torch, lightning"], cwd=work, env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    done = None
    for now, line in lines_as_read(proc):
        parsed = parse_importtime(line)
        if parsed is not None and parsed[1] == "lightning" and parsed[2] == 0:
            done = now
    if proc.wait() != 0 or done is None:
        raise RuntimeError(f"python -c 'import torch, lightning' failed (exit {proc.returncode})")
    return {"imported": done - launch, "exit": time.monotonic() - launch}


def isolated(ckpt_dir: Path, data: Path, tok: Path, work: Path) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", ISOLATED, str(ckpt_dir), str(data), str(tok)], cwd=work, env=env(),
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(quick: bool = False, results_dir: Path = RESULTS_DIR, reps: int | None = None,
        threads: int | None = None) -> dict[str, Any]:
    threads = set_threads(threads)  # exported to the child processes as OMP_NUM_THREADS
    spec = QUICK if quick else FULL
    reps = reps or spec["reps"]
    data, tok = default_data()
    work = Path(tempfile.mkdtemp(prefix="bench-restart-", dir=cache_dir()))
    say(f"== restart breakdown (resume start of a {MODEL['hidden_size']}x{MODEL['num_hidden_layers']} model, "
        f"{reps} rotated repetitions, {threads} torch thread(s)) ==")
    try:
        args = cli_args(data, tok, work)
        subprocess.run([sys.executable, "-m", "lit_minimind.fit", *args, "--trainer.max_steps", str(TRAINED_STEPS),
                        "--resume.save_interval", str(TRAINED_STEPS)], cwd=work, env=env(), check=True, capture_output=True)
        resume = args + ["--ckpt_path", "last", "--resume.save_interval", str(10**9)]  # killed before any save
        kinds = ["resume -X importtime", "resume", "import torch, lightning", "isolated parts"]
        runs: dict[str, list[Any]] = {k: [] for k in kinds}
        for rep in range(reps):
            for kind in alternating(kinds, rep):
                if kind == "resume -X importtime":
                    r = run_resume(resume, work, importtime=True)
                    if r["first"].get("step") != TRAINED_STEPS + 1:
                        raise RuntimeError(f"the resume's first console line is step {r['first'].get('step')}, "
                                           f"expected {TRAINED_STEPS + 1}")
                elif kind == "resume":
                    r = run_resume(resume, work, importtime=False)
                elif kind == "import torch, lightning":
                    r = bare_import(work)
                else:
                    r = isolated(work / "checkpoints", data, tok, work)
                runs[kind].append(r)
            say(f"  rep {rep + 1}/{reps}: {runs['resume -X importtime'][-1]['events']['first_line']:.2f} s to the first "
                f"optimizer step (-X importtime), {runs['resume'][-1]['events']['first_line']:.2f} s without; "
                f"import torch, lightning {runs['import torch, lightning'][-1]['imported']:.2f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)

    traced = runs["resume -X importtime"]
    phases = {label: stats([phases_of(r)[label] for r in traced]) for label, _ in PHASES}
    parts = {k: stats([r[k] for r in runs["isolated parts"]]) for k in runs["isolated parts"][0]}
    late = late_imports(traced[0]) if reps == 1 else {
        label: {"seconds": stats([late_imports(r)[label]["seconds"] for r in traced])["median"],
                "count": late_imports(traced[0])[label]["count"],
                "largest": late_imports(traced[0])[label]["largest"],
                "largest_s": stats([late_imports(r)[label]["largest_s"] for r in traced])["median"]}
        for label, _ in PHASES[2:]}
    total = stats([r["events"]["first_line"] for r in traced])
    plain = stats([r["events"]["first_line"] for r in runs["resume"]])
    bare = stats([r["imported"] for r in runs["import torch, lightning"]])
    bare_exit = stats([r["exit"] for r in runs["import torch, lightning"]])
    # each package's first import, its cumulative time (what it loaded that nothing had loaded before it)
    top_imports = sorted(((stats([r["packages"].get(name, 0) / 1e6 for r in traced])["median"], name)
                          for name in traced[0]["packages"] if name != "lit_minimind"), reverse=True)[:8]

    def cell(s: dict[str, Any]) -> str:
        return f"{s['median']:.3f}" + (f" ({s['min']:.3f}–{s['max']:.3f})" if s["n"] > 1 else "")

    rows = []
    for label, _ in PHASES:
        li = late.get(label)
        note = ""
        if li and li["count"]:
            note = f"{li['seconds']:.3f} s in {li['count']} late import(s), largest {li['largest']} {li['largest_s']:.3f} s"
        rows.append([label, cell(phases[label]), f"{phases[label]['median'] / total['median']:.0%}", note])
        if label.startswith("model + Trainer"):
            for part, s in parts.items():
                rows.append([f"… of which {part} (isolated, fresh process)", cell(s), f"{s['median'] / total['median']:.0%}", ""])
    rows.append(["**launch → first optimizer step** (with -X importtime)", cell(total), "100%", ""])
    rows.append(["the same resume without -X importtime", cell(plain), f"{plain['median'] / total['median']:.0%}", ""])
    rows.append(['`python -X importtime -c "import torch, lightning"`: imports done', cell(bare),
                 f"{bare['median'] / total['median']:.0%}", "with matplotlib, which torchmetrics loads here; the CLI switches that off"])
    rows.append(["… and the process's exit", cell(bare_exit), f"{bare_exit['median'] / total['median']:.0%}", ""])
    text = table(["phase", "s med (min–max)", "share", "late imports in it (-X importtime)"], rows)
    verdict = (f"A resume start of the tiny model reaches its first optimizer step {plain['median']:.2f} s after launch; "
               f"`import torch, lightning` alone (with -X importtime; it also loads matplotlib through torchmetrics, which "
               f"the CLI switches off) takes {bare['median']:.2f} s, {bare['median'] / total['median']:.0%} "
               f"of the resume start's {total['median']:.2f} s with -X importtime. Largest packages' first imports (-X importtime, cumulative: "
               "a package's time includes what it imported first): "
               + ", ".join(f"{name} {s:.2f} s" for s, name in top_imports[:5]) + ".")
    say(text)
    say(verdict)
    payload = {"benchmark": "restart", "quick": quick, "reps": reps, "threads": threads, "environment": environment(),
               "model": MODEL, "max_seq_len": MAX_SEQ_LEN, "batch_size": BATCH_SIZE, "trained_steps": TRAINED_STEPS,
               "phases_s": phases, "isolated_parts_s": parts, "late_imports": late,
               "launch_to_first_step_s": total, "launch_to_first_step_plain_s": plain, "import_torch_lightning_s": bare,
               "import_torch_lightning_exit_s": bare_exit,
               "top_imports_s": [{"name": n, "cumulative_s": s} for s, n in top_imports],
               "table": text, "verdict": verdict,
               "runs": {"events": [r["events"] for r in traced], "plain_events": [r["events"] for r in runs["resume"]]}}
    write_json(results_dir / "restart.json", payload)
    plot(phases, parts, results_dir / "restart.png")
    return payload


def plot(phases: dict[str, dict[str, Any]], parts: dict[str, dict[str, Any]], path: Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 2.8))
    left = 0.0
    for label, s in phases.items():
        ax.barh(["resume start"], [s["median"]], left=left, label=label)
        left += s["median"]
    left = sum(s["median"] for s in list(phases.values())[:3])
    for label, s in parts.items():
        ax.barh(["isolated parts"], [s["median"]], left=left, label=label, hatch="//")
        left += s["median"]
    ax.set_xlabel("seconds after launch (medians)")
    ax.set_title("restart breakdown: launch → first optimizer step")
    ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, "rotated repetitions (default 5, quick 1)")
    args = parser.parse_args(argv)
    run(args.quick, args.results_dir, args.reps, args.threads)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
