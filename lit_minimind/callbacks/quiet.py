"""Lightning's notices that say nothing about a run, hidden: in the CLI and, by one call, in a user's own script.

:func:`hide_harmless_noise` filters its litlogger and litmodels tips, ``GPU available: ... / TPU available: ...``,
``Total Flops: 0``, the model summary's "Precision bf16-mixed is not supported", the tensorboardX notice, the
``log_every_n_steps`` "smaller than the logging interval" warning, torch's ``_pytree`` ``LeafSpec`` deprecation in
Lightning's code, and under DDP the ``sync_dist=True`` advice for LitMiniMind's epoch means (torchmetrics reduced them
already): logging filters on the loggers that print them, warnings filters on their messages (the texts:
:mod:`lit_minimind.resume.internals`, with every other use of Lightning's internals). ``LIT_MINIMIND_VERBOSE=1``
shows everything.
"""

from __future__ import annotations

import logging
import os
import warnings

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
