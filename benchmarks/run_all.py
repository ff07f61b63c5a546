"""Run every benchmark (make bench) and write summary.md: port overhead, checkpoint cost, resume cost, verify speed,
data set-up, checkpoints on object storage, the restart breakdown, goodput under chaos. Each writes ``<name>.json``
and ``<name>.png`` under the results directory (default ``benchmarks/results/``); after a full run into the default
directory the tables in ``benchmarks/README.md`` (between the ``bench-results`` markers) are refreshed. ``python -m
benchmarks.run_all [--quick] [--only NAME ...] [--reps N] [--results-dir DIR] [--threads N] [--no-readme] [any
benchmark's options]``; ``--quick``: toy sizes, numbers mean nothing. A section of summary.md: the benchmark's
docstring (title, then what it measures) and its tables. ``python -m benchmarks.bench_<name>`` runs one alone.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import re
import sys
import time
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any

from benchmarks import common as bc
from lit_minimind.checkpoint.atomic import atomic_write_bytes

BENCHMARKS = {name: importlib.import_module(f"benchmarks.bench_{name}")
              for name in ("overhead", "checkpoint", "resume", "verify", "data", "remote", "restart", "chaos")}
README = Path(__file__).resolve().parent / "README.md"
START, END = "<!-- bench-results:start -->", "<!-- bench-results:end -->"


def tables(payload: dict[str, Any]) -> list[str]:
    """The tables and verdicts of a payload, in its order (what a run prints and its ``summary.md`` section shows)."""
    return [value for key, value in payload.items() if key.endswith(("table", "verdict")) and value]


def execute(module: ModuleType, args: argparse.Namespace) -> dict[str, Any]:
    """Run one benchmark module with the options its ``run`` takes, print its tables, write ``<NAME>.json`` (and its
    plot) under ``--results-dir``."""
    head = {"benchmark": module.NAME, "quick": args.quick, "threads": args.threads, "environment": bc.environment()}
    bc.say(f"== {module.__doc__.splitlines()[0].rstrip('.')} ({'--quick: toy size' if args.quick else 'full size'}, "
           f"{args.threads} torch thread(s)) ==")
    options = {k: v for k, v in vars(args).items() if k in inspect.signature(module.run).parameters}
    payload = {**head, **module.run(**options)}
    for value in tables(payload):
        bc.say(value)
    write = lambda name, content: atomic_write_bytes(json.dumps(content, indent=1, default=str) + "\n",
                                                     args.results_dir / f"{name}.json")
    for name, part in payload.pop("also_written", {}).items():  # a second results file from the same runs
        write(name, {**head, "benchmark": name, **part})
    write(payload.get("results_file", module.NAME), payload)
    if hasattr(module, "plot"):
        module.plot(payload, args.results_dir / f"{module.NAME}.png")
    return payload


def summary(payloads: dict[str, dict[str, Any]]) -> str:
    """One section per benchmark, numbered in ``BENCHMARKS``' order: the title of its docstring (up to the first
    colon) as the heading, the rest as markdown, then its tables."""
    first = next(iter(payloads.values()))
    env, load = first["environment"], first["environment"].get("loadavg_at_start")
    quick = " (--quick: toy sizes, numbers mean nothing)" if any(p["quick"] for p in payloads.values()) else ""
    lines = [f"Measured on {env['cpu_count']} CPU cores ({env['processor']}, {env['platform']}), Python "
             f"{env['python']}, torch {env['torch']}, Lightning {env['lightning']}, {first.get('threads')} torch "
             f"thread(s) per process; load average (1, 5, 15 min) when the first one started "
             f"{', '.join(f'{x:.2f}' for x in load) if load else 'n/a'}{quick}.", ""]
    for name, p in payloads.items():
        title, _, about = BENCHMARKS[name].__doc__.strip().partition(": ")  # "Title: what it is.\n\nhow ..."
        about = re.sub(r":\w+:`", "`", about[:1].upper() + about[1:].replace("``", "`"))  # rst as markdown
        lines += [f"### {list(BENCHMARKS).index(name) + 1}. {title} (repetitions: {p['reps']}; "
                  f"{p['environment']['date']})", "", about.replace("\n\n", "\n"), ""]
        lines += [part for text in tables(p) for part in (text, "")]
    return "\n".join(lines)


def update_readme(text: str, readme: Path = README) -> bool:
    """The tables between ``START`` and ``END`` in ``readme`` replaced by ``text``; False: no such markers."""
    if not readme.exists() or START not in (content := readme.read_text()) or END not in content:
        return False
    head, rest = content.split(START, 1)
    _, tail = rest.split(END, 1)
    atomic_write_bytes(f"{head}{START}\n{text.rstrip()}\n{END}{tail}", readme)
    return True


def main(argv: list[str] | None = None, alone: str | None = None) -> int:
    """The one command line: ``python -m benchmarks.run_all`` (the benchmarks, then summary.md) and, with ``alone``,
    ``python -m benchmarks.bench_<alone>``. Options: the shared ones and every benchmark's ``ARGS``."""
    modules = {alone: importlib.import_module(f"benchmarks.bench_{alone}")} if alone else BENCHMARKS
    about = modules[alone] if alone else sys.modules[__name__]
    parser = argparse.ArgumentParser(description=about.__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="toy sizes (smoke test; numbers mean nothing)")
    parser.add_argument("--reps", type=int, default=None, help="repetitions (each benchmark has its default)")
    parser.add_argument("--results-dir", type=Path, default=bc.RESULTS_DIR)
    parser.add_argument("--threads", type=int, default=None, help="torch threads per process (default 1)")
    if not alone:
        parser.add_argument("--only", nargs="+", choices=list(modules), default=list(modules))
        parser.add_argument("--no-readme", action="store_true", help="keep the tables in benchmarks/README.md")
    for flags, kwargs in {f[0]: (f, kw) for m in modules.values() for f, kw in getattr(m, "ARGS", ())}.values():
        parser.add_argument(*flags, **kwargs)  # an option two benchmarks share (--minimind-python) added once
    args = parser.parse_args(argv)
    args.threads = bc.set_threads(args.threads)
    start, payloads, failed = time.perf_counter(), {}, []
    for name in [alone] if alone else args.only:
        try:
            payloads[name] = execute(modules[name], args)
            if payloads[name].get("exit_status"):  # bench_gpu: a bit-for-bit check failed
                failed.append(name)
        except bc.BenchError as err:
            print(err, file=sys.stderr)
            return 2
        except Exception:  # report, keep going with the others, fail at the end
            traceback.print_exc()
            failed.append(name)
        bc.say("")
    if payloads and not alone and not args.quick:  # the summary also shows the latest full results of the others
        for name in BENCHMARKS:
            path = args.results_dir / f"{name}.json"
            if name not in payloads and name not in failed and path.exists():
                if not (earlier := json.loads(path.read_text()))["quick"]:
                    payloads[name] = earlier
    if payloads and not alone:
        text = summary({name: payloads[name] for name in BENCHMARKS if name in payloads})
        atomic_write_bytes(text + "\n", args.results_dir / "summary.md")
        full_default = not args.quick and args.results_dir.resolve() == bc.RESULTS_DIR.resolve()
        if full_default and set(payloads) == set(BENCHMARKS) and not args.no_readme and update_readme(text):
            bc.say(f"tables refreshed in {README}")
        bc.say(f"results in {args.results_dir}/ (summary.md, *.json, *.png); "
               f"{(time.perf_counter() - start) / 60:.1f} min")
    if failed:
        bc.say(f"FAILED: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
