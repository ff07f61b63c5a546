"""``make test-mutants``: break the product on purpose, from outside it, and require the suite to notice.

Each mutant (tests/mutants/sitecustomize.py, chosen by ``LIT_MINIMIND_MUTANT``) patches one behaviour
in every process the tests start. For each, a few tests chosen to catch it run with ``-x``; at least one
must fail, and the patch must have been applied at least once. Prints a table mutant -> catching tests
and writes it as JSON (``--json``, default ``mutants.json``). Exit 1 if a mutant survives.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MUTANT_DIR = ROOT / "tests" / "mutants"

# mutant -> the tests meant to catch it (the cheapest that do; found by running each mutant once
# against the resume tests and keeping the fast ones that failed)
CATCHERS: dict[str, list[str]] = {
    "resume_fresh": [
        "tests/test_interop.py::test_resume_from_original_minimind_file_reproduces_its_resumed_run[dense]",
        "tests/test_precision_resume.py::test_moved_scale_is_restored[ckpt]",
    ],
    "data_not_skipped": [
        "tests/test_interop.py::test_resume_from_original_minimind_file_reproduces_its_resumed_run[dense]",
    ],
    "optimizer_not_restored": [
        "tests/test_interop.py::test_resume_from_original_minimind_file_reproduces_its_resumed_run[dense]",
    ],
    "save_mid_window": [
        "tests/test_own_script.py::test_own_script_killed_and_rerun_resumes_exactly",
    ],
    "scaler_not_restored": [
        "tests/test_precision_resume.py::test_moved_scale_is_restored[ckpt]",
    ],
    "rng_not_restored": [
        "tests/test_resume_exact.py::test_dropout_draws_continue_after_a_resume[async]",
    ],
    "wandb_id_not_passed": [
        "tests/test_wandb.py::test_killed_twice_one_run_id_and_one_clean_history",
    ],
}


def run_mutant(name: str, tests: list[str], log: Path) -> dict:
    env = {**os.environ, "LIT_MINIMIND_MUTANT": name, "LIT_MINIMIND_MUTANT_LOG": str(log),
           "PYTHONPATH": os.pathsep.join([str(MUTANT_DIR), str(ROOT)]), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:randomly", "-p", "no:cacheprovider", "-n", "0",
           "-rf", *tests]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    failed = sorted(set(re.findall(r"^(?:FAILED|ERROR) (\S+)", proc.stdout, re.M)))
    applied = log.read_text().splitlines() if log.exists() else []
    return {"mutant": name, "tests": tests, "caught_by": failed, "applied": len(applied),
            "seconds": round(time.monotonic() - start, 1), "pytest_exit": proc.returncode,
            "tail": proc.stdout[-1500:] if not failed else ""}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mutants", nargs="*", default=list(CATCHERS), help="default: all")
    parser.add_argument("--json", default="mutants.json", help="where to write the results")
    args = parser.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.mutants:
            result = run_mutant(name, CATCHERS[name], Path(tmp) / f"{name}.log")
            results.append(result)
            verdict = "caught" if result["caught_by"] and result["applied"] else \
                ("NOT APPLIED" if not result["applied"] else "SURVIVED")
            print(f"{name:24} {verdict:12} {result['seconds']:6.0f} s  {', '.join(result['caught_by']) or '-'}",
                  flush=True)
            if verdict != "caught" and result["tail"]:
                print(result["tail"], flush=True)
    Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    survived = [r["mutant"] for r in results if not (r["caught_by"] and r["applied"])]
    print(f"{len(results) - len(survived)}/{len(results)} mutants caught; results in {args.json}")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
