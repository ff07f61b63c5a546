"""Test-only: loaded at start-up by every Python process the tests start (its directory is on their
``PYTHONPATH``, see ``tests/conftest.py``); installs the fault injection of :mod:`tests.helpers.faults`
when a test asks for it. Never on a user's path."""

import os

if any(k.startswith(("LIT_MINIMIND_TEST_FAIL", "LIT_MINIMIND_TEST_STOP_")) for k in os.environ):
    from tests.helpers import faults

    faults.install()
