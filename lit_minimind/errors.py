"""Every exception type of lit_minimind, in one module (nothing of the package imported: no import circles),
and :func:`say`, the one way a line a user should read (not an error) reaches them."""

from __future__ import annotations

import sys


def say(message: str) -> None:
    """A line a user should read (a fresh start, a skipped damaged checkpoint, a resume inside an accumulation
    window, ...): plain, on stderr, from global rank 0 only; the same in the CLI and in a user's own Lightning
    script, never a Python warning with a file name and line number in front."""
    if _global_rank() == 0:
        print(message, file=sys.stderr, flush=True)


def _global_rank() -> int:
    """This process's global rank as Lightning's ``rank_zero_*`` functions know it (from the launcher's environment,
    then the strategy's); 0 where Lightning is not loaded."""
    module = sys.modules.get("lightning.fabric.utilities.rank_zero")
    return int(getattr(getattr(module, "rank_zero_only", None), "rank", 0) or 0)


class DataError(ValueError):
    """Invalid or missing input data (datasets, tokenizers, corpora).

    Messages always name the offending path, and the 1-based line number for
    per-line problems, so users can fix their data without a debugger.
    """


class UsageError(ValueError):
    """An invalid command line: the message names the flag and the value (printed as one ``error:`` line)."""


class CheckpointError(RuntimeError):
    """A checkpoint file that cannot be used; the message names the file and the problem."""


class PositionError(ValueError):
    """A saved position that cannot exist for this data (e.g. beyond the end of an epoch)."""


class NotACheckpoint(CheckpointError):
    """The file is no checkpoint at all (JSON, text, another kind of binary or zip)."""


class UnverifiableCheckpoint(CheckpointError):
    """A file ``torch.load`` may read but whose integrity cannot be checked: it has no checksums."""


class NotATorchZip(UnverifiableCheckpoint):
    """A pickle stream: torch's legacy pre-1.6 format (``legacy``), or a plain pickle. Not a zip, no checksums."""

    def __init__(self, message: str, legacy: bool = False) -> None:
        super().__init__(message)
        self.legacy = legacy
