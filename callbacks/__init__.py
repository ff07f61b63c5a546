"""lit-minimind's Lightning callbacks."""

from callbacks.console import MiniMindConsole, format_minimind_line
from callbacks.files import CheckpointFiles, resolve_last
from callbacks.resume import ResumeCallback

__all__ = ["ResumeCallback", "CheckpointFiles", "MiniMindConsole", "format_minimind_line", "resolve_last"]
