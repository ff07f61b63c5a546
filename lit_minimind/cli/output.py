"""What the console shows of a run: lines that start lines, and no warning a user cannot act on.

* :func:`lines_start_lines`: stdout and stderr wrapped so that a write never continues a line another
  stream or thread left open (a progress bar's frame, half a ``print``): a newline goes first. An
  ``error:`` line, a warning or a background writer's line after a bar fragment starts its own line.
* Lightning's notices that say nothing about a run are filtered by
  :func:`lit_minimind.callbacks.quiet.hide_harmless_noise` (``LIT_MINIMIND_VERBOSE=1`` shows everything).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import Any


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
