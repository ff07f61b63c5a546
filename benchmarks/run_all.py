"""Run every benchmark (make bench) and write summary.md: port overhead, checkpoint cost, resume cost, verify speed,
data set-up, checkpoints on object storage, the restart breakdown, goodput under chaos. Each writes ``<name>.json`` and ``<name>.png`` under
the results directory (default ``benchmarks/results/``); after a full run into the default directory the tables in
``benchmarks/README.md`` (between the ``bench-results`` markers) are refreshed. ``python -m benchmarks.run_all
[--quick] [--only NAME ...] [--results-dir DIR] [--threads N] [--no-readme]``; ``--quick``: toy sizes, numbers mean
nothing. A section of summary.md: the benchmark's docstring (title, then what it measures) and its tables.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS_DIR, execute, say, tables
from lit_minimind.checkpoint.atomic import atomic_write_bytes

BENCHMARKS = {name: importlib.import_module(f"benchmarks.bench_{name}")
              for name in ("overhead", "checkpoint", "resume", "verify", "data", "remote", "restart", "chaos")}
README = Path(__file__).resolve().parent / "README.md"
START, END = "<!-- bench-results:start -->", "<!-- bench-results:end -->"


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
    if not readme.exists():
        return False
    content = readme.read_text()
    if START not in content or END not in content:
        return False
    head, rest = content.split(START, 1)
    _, tail = rest.split(END, 1)
    atomic_write_bytes(f"{head}{START}\n{text.rstrip()}\n{END}{tail}", readme)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="toy sizes, seconds (the smoke test)")
    parser.add_argument("--only", nargs="+", choices=list(BENCHMARKS), default=list(BENCHMARKS))
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--threads", type=int, default=None, help="torch threads per process (default 1)")
    parser.add_argument("--no-readme", action="store_true", help="do not refresh the tables in benchmarks/README.md")
    args = parser.parse_args(argv)
    start, payloads, failed = time.perf_counter(), {}, []
    for name in args.only:
        try:
            payloads[name] = execute(BENCHMARKS[name], args.results_dir, args.quick, threads=args.threads)
        except Exception:  # report, keep going with the others, fail at the end
            traceback.print_exc()
            failed.append(name)
        say("")
    if payloads and not args.quick:  # the summary also shows the latest full results of benchmarks not run now
        for name in BENCHMARKS:
            path = args.results_dir / f"{name}.json"
            if name not in payloads and name not in failed and path.exists():
                if not (earlier := json.loads(path.read_text()))["quick"]:
                    payloads[name] = earlier
    payloads = {name: payloads[name] for name in BENCHMARKS if name in payloads}
    if payloads:
        text = summary(payloads)
        atomic_write_bytes(text + "\n", args.results_dir / "summary.md")
        full_default = not args.quick and args.results_dir.resolve() == RESULTS_DIR.resolve()
        if full_default and set(payloads) == set(BENCHMARKS) and not args.no_readme and update_readme(text):
            say(f"tables refreshed in {README}")
        say(f"results in {args.results_dir}/ (summary.md, *.json, *.png); {(time.perf_counter() - start) / 60:.1f} min")
    if failed:
        say(f"FAILED: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
