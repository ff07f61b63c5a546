"""lit-minimind's Lightning callbacks."""

from lit_minimind.callbacks.console import MiniMindConsole, format_minimind_line
from lit_minimind.callbacks.files import CheckpointFiles, resolve_last
from lit_minimind.callbacks.resume import ResumeCallback

__all__ = ["ResumeCallback", "CheckpointFiles", "MiniMindConsole", "format_minimind_line", "resolve_last"]
