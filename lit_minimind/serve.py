"""``python -m lit_minimind.serve``: the entry point of :mod:`lit_minimind.cli.serve`."""

from lit_minimind.cli import leaving
from lit_minimind.cli.serve import main

if __name__ == "__main__":
    raise SystemExit(leaving(main()))
