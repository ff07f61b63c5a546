"""``python -m lit_minimind.train_tokenizer``: the entry point of :mod:`lit_minimind.cli.train_tokenizer`."""

from lit_minimind.cli import leaving
from lit_minimind.cli.train_tokenizer import main

if __name__ == "__main__":
    raise SystemExit(leaving(main()))
