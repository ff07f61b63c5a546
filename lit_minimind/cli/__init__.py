"""The command line: fit, MiniMind's flags, validation, generate, inspect (the only importer of ``callbacks``)."""
