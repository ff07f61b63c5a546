"""pytest's hooks for this suite. The helpers the tests share are in :mod:`tests.helpers.runs`."""

from __future__ import annotations

# for the test files that still say ``from conftest import ...`` (tests/test_fault_*.py, tests/test_bench*.py)
from tests.helpers.runs import (  # noqa: F401
    MINIMIND,
    ROOT,
    SHARED_ABSENT,
    assert_resumed,
    cli_env,
    expected_resume,
    need_shared,
    run_cli,
    tiny_args,
)


def pytest_terminal_summary(terminalreporter) -> None:  # noqa: ANN001
    """Say at the end of a run how many tests skipped because ``../shared`` is not beside the checkout."""
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if SHARED_ABSENT in str(r.longrepr)]
    if skipped:
        terminalreporter.write_line(f"{len(skipped)} tests skipped: MiniMind's reference data ({MINIMIND}) is absent; "
                                    "put the project's shared/ folder beside the checkout to run them")
