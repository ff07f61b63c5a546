"""``python -m lit_minimind.eval``: the entry point of :mod:`lit_minimind.cli.eval`."""

from lit_minimind.cli import leaving
from lit_minimind.cli.eval import main

if __name__ == "__main__":
    raise SystemExit(leaving(main()))
