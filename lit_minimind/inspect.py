"""``python -m lit_minimind.inspect``: the entry point of :mod:`lit_minimind.cli.inspect`."""

from lit_minimind.cli import leaving
from lit_minimind.cli.inspect import main

if __name__ == "__main__":
    raise SystemExit(leaving(main()))
