"""``python -m lit_minimind.export``: the entry point of :mod:`lit_minimind.cli.export`."""

from lit_minimind.cli import leaving
from lit_minimind.cli.export import main

if __name__ == "__main__":
    raise SystemExit(leaving(main()))
