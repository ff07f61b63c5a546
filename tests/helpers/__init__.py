"""Test-only code that the CLI under test imports (``--trainer.callbacks tests.helpers...``)."""
