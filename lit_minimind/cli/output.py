"""What the console shows of a run: lines that start lines, and no warning a user cannot act on.

* :func:`lines_start_lines`: stdout and stderr wrapped so that a write never continues a line another
  stream or thread left open (a progress bar's frame, half a ``print``): a newline goes first. An
  ``error:`` line, a warning or a background writer's line after a bar fragment starts its own line.
* :func:`hide_harmless_noise`: Lightning's notices that say nothing about this run (its litlogger and
  litmodels tips, ``GPU available: ... / TPU available: ...``, ``Total Flops: 0``, the model summary's
  "Precision bf16-mixed is not supported", the tensorboardX notice, the ``log_every_n_steps`` "smaller than
  the logging interval" warning, torch's ``_pytree`` ``LeafSpec`` deprecation in Lightning's code, under
  DDP the ``sync_dist=True`` advice for LitMiniMind's epoch means, which torchmetrics reduced already) are
  filtered: logging filters on the loggers that print them, warnings filters on their messages (the texts:
  :mod:`lit_minimind.resume.internals`, with every other use of Lightning's internals).
  ``LIT_MINIMIND_VERBOSE=1`` shows everything.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

from lit_minimind.resume.internals import NO_FLOPS, NOISE_LINES, NOISE_WARNINGS, NOISY_LOGGERS

VERBOSE_ENV = "LIT_MINIMIND_VERBOSE"


def verbose() -> bool:
    """``LIT_MINIMIND_VERBOSE`` set to anything but empty, ``0``, ``false`` or ``no``."""
    return os.environ.get(VERBOSE_ENV, "").strip().lower() not in ("", "0", "false", "no")


class HarmlessLines(logging.Filter):
    """Drops the known-harmless lines of :data:`NOISE_LINES`; removes ``Total Flops: 0`` from the model summary."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if any(p.match(message) for p in NOISE_LINES):
            return False
        if NO_FLOPS.search(message):
            record.msg, record.args = NO_FLOPS.sub("", message).rstrip("\n"), None
        return True


HARMLESS_LINES = HarmlessLines()


def hide_harmless_noise() -> bool:
    """Install the filters (once per process; ``addFilter`` adds a filter once); False under
    ``LIT_MINIMIND_VERBOSE=1``, where nothing is filtered."""
    if verbose():
        return False
    for pattern in NOISE_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    for name in NOISY_LOGGERS:
        logging.getLogger(name).addFilter(HARMLESS_LINES)
    return True


class _Lines:
    """Shared by the wrapped streams: which (stream, thread) left a line open, which stream wrote last."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.open: tuple[LineStart, int] | None = None
        self.last: LineStart | None = None


def _where(stream: Any) -> tuple[int, int] | None:
    try:
        st = os.fstat(stream.fileno())
    except (AttributeError, OSError, ValueError):  # io.StringIO, a closed stream
        return None
    return st.st_dev, st.st_ino


class LineStart:
    """A text stream whose writes start a line of their own when another stream to the same place (stdout
    and stderr on a terminal, or a ``> log 2>&1``) or another thread left a line open: a newline first.
    Everything else is the wrapped stream's (``isatty``, ``fileno``, ``encoding``, ...)."""

    def __init__(self, stream: Any, lines: _Lines) -> None:
        self.stream = stream
        self._lines = lines
        self._where = _where(stream)

    def _shares_lines_with(self, other: LineStart) -> bool:
        return other is self or (self._where is not None and self._where == other._where)

    def write(self, text: str) -> int:
        if not text:
            return self.stream.write(text)
        lines = self._lines
        with lines.lock:
            if lines.last is not None and lines.last is not self:
                lines.last.stream.flush()  # what the other stream wrote comes first
            redraw = text.startswith("\r") and lines.open is not None and lines.open[0] is self  # tqdm's monitor thread
            if (lines.open is not None and lines.open != (self, threading.get_ident()) and not redraw
                    and self._shares_lines_with(lines.open[0]) and not text.startswith("\n")):
                lines.open[0].stream.write("\n")
                lines.open[0].stream.flush()
            written = self.stream.write(text)
            lines.last = self
            lines.open = None if text.endswith("\n") else (self, threading.get_ident())
            return written

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def lines_start_lines() -> Callable[[], None]:
    """Wrap ``sys.stdout`` and ``sys.stderr`` in :class:`LineStart` (and the logging handlers that write to
    them: Lightning's); returns the function that puts everything back."""
    if isinstance(sys.stdout, LineStart) or isinstance(sys.stderr, LineStart):
        return lambda: None
    lines = _Lines()
    before = {"stdout": sys.stdout, "stderr": sys.stderr}
    wrapped = {id(stream): LineStart(stream, lines) for stream in before.values() if stream is not None}
    handlers = []
    for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
        for handler in getattr(logger, "handlers", []):
            if isinstance(handler, logging.StreamHandler) and id(handler.stream) in wrapped:
                handlers.append((handler, handler.stream))
                handler.setStream(wrapped[id(handler.stream)])
    sys.stdout, sys.stderr = (wrapped.get(id(s), s) for s in before.values())

    def restore() -> None:
        for stream in (sys.stdout, sys.stderr):
            if isinstance(stream, LineStart):
                stream.flush()
        for handler, stream in handlers:
            if isinstance(handler.stream, LineStart):
                handler.setStream(stream)
        if isinstance(sys.stdout, LineStart):
            sys.stdout = before["stdout"]
        if isinstance(sys.stderr, LineStart):
            sys.stderr = before["stderr"]

    return restore
