"""Exception types shared across lit_minimind."""

from __future__ import annotations


class DataError(ValueError):
    """Invalid or missing input data (datasets, tokenizers, corpora).

    Messages always name the offending path, and the 1-based line number for
    per-line problems, so users can fix their data without a debugger.
    """


class UsageError(ValueError):
    """An invalid command line: the message names the flag and the value (printed as one ``error:`` line)."""
