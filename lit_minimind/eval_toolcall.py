"""``python -m lit_minimind.eval_toolcall``: the entry point of :mod:`lit_minimind.cli.eval_toolcall`."""

from lit_minimind.cli import leaving
from lit_minimind.cli.eval_toolcall import main

if __name__ == "__main__":
    raise SystemExit(leaving(main()))
