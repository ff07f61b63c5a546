"""``python -m lit_minimind.generate``: the entry point of :mod:`lit_minimind.cli.generate`."""

from lit_minimind.cli import leaving
from lit_minimind.cli.generate import main

if __name__ == "__main__":
    raise SystemExit(leaving(main()))
