"""Test-only: loaded at start-up by every Python process the tests start (its directory is on their
``PYTHONPATH``, see ``tests/helpers/runs.py:cli_env``); installs the fault injection of :mod:`tests.helpers.faults`
when a test asks for it. Never on a user's path."""

from tests.helpers import faults  # standard library only until install()

if faults.wanted():
    faults.install()
