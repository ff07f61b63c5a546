"""``python -m lit_minimind.pipeline``: the entry point of :mod:`lit_minimind.cli.pipeline`."""

from lit_minimind.cli import leaving
from lit_minimind.cli.pipeline import main

if __name__ == "__main__":
    raise SystemExit(leaving(main()))
