"""``python -m lit_minimind.report evaluate|card RUN_DIR``: a pipeline run's evaluation, or its report card
(``report.md``, ``report.html``), from what its stages wrote (``pipeline.json`` in RUN_DIR)."""

import argparse
import sys
from pathlib import Path

from lit_minimind.cli import leaving
from lit_minimind.cli.plain import description


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lit_minimind.report", description=description(__doc__))
    parser.add_argument("what", choices=("evaluate", "card"), help="evaluate: every stage's model; card: the report")
    parser.add_argument("run_dir", help="a pipeline's run directory (it holds pipeline.json)")
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir)
    if not (run_dir / "pipeline.json").is_file():
        print(f"error: {run_dir}: no pipeline.json (not a run directory of python -m lit_minimind.pipeline)", file=sys.stderr)
        return 2
    if args.what == "evaluate":
        from lit_minimind.report.evaluate import evaluate_run

        return evaluate_run(run_dir)
    from lit_minimind.report.card import write_card

    return write_card(run_dir)


if __name__ == "__main__":
    raise SystemExit(leaving(main()))
