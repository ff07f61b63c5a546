"""Docstring text as a terminal shows it: reStructuredText markup dropped. Standard library only, so that
every command's ``--help`` can use it without importing jsonargparse (``python -m lit_minimind.fit --help``
uses it through :mod:`lit_minimind.cli.help`)."""

from __future__ import annotations

import re

# :class:`x`, :py:meth:`~a.b.c`, :fu nc:`x` (a role a wrapped line cut): the target; ``x``: x
_ROLE = re.compile(r":(?:[a-z]+:)?[a-z]+:`~?([^`]+)`")
_LITERAL = re.compile(r"``(.*?)``", re.S)


def plain(text: str) -> str:
    """A docstring's text without reStructuredText markup (roles, double backticks, ``.. note::``)."""
    text = _ROLE.sub(lambda m: m[1], text)
    text = _LITERAL.sub(lambda m: m[1], text)
    text = re.sub(r"\.\. \w+::\s*", "", text)
    return re.sub(r"\s+", " ", text).strip()


def description(doc: str | None) -> str:
    """A command's ``--help`` description: its module docstring's first paragraph, as plain text."""
    return plain((doc or "").strip().split("\n\n")[0])
