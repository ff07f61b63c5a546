"""lit-minimind's Lightning callbacks."""

from callbacks.console import MiniMindConsole, format_minimind_line
from callbacks.resume import ResumeCallback, resolve_last

__all__ = ["ResumeCallback", "MiniMindConsole", "format_minimind_line", "resolve_last"]
