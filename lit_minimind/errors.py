"""Every exception type of lit_minimind, in one module (nothing imported: no import circles)."""

from __future__ import annotations


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
