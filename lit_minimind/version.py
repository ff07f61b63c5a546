"""The package version (a leaf: importing it imports nothing else of the package)."""

__version__ = "0.1.0"
