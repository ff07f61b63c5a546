"""``python -m lit_minimind.merge_lora``: the entry point of :mod:`lit_minimind.cli.merge_lora`."""

from lit_minimind.cli import leaving
from lit_minimind.cli.merge_lora import main

if __name__ == "__main__":
    raise SystemExit(leaving(main()))
