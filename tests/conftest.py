"""pytest's hooks for this suite. The helpers the tests share are in :mod:`tests.helpers.runs`."""

from __future__ import annotations

from tests.helpers.runs import MINIMIND, SHARED_ABSENT


def pytest_terminal_summary(terminalreporter) -> None:  # noqa: ANN001
    """Say at the end of a run how many tests skipped because ``../shared`` is not beside the checkout."""
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if SHARED_ABSENT in str(r.longrepr)]
    if skipped:
        terminalreporter.write_line(f"{len(skipped)} tests skipped: MiniMind's reference data ({MINIMIND}) is absent; "
                                    "put the project's shared/ folder beside the checkout to run them")
