"""``python -m lit_minimind.fit``: the entry point of :mod:`lit_minimind.cli.fit`."""

from lit_minimind.cli.fit import main

if __name__ == "__main__":
    raise SystemExit(main())
