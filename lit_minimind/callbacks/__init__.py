"""lit-minimind's Lightning callbacks."""

from lit_minimind.callbacks.console import MiniMindConsole, format_minimind_line
from lit_minimind.callbacks.resume import ResumeCallback
from lit_minimind.resume.manager import CheckpointFiles
from lit_minimind.resume.start import resolve_last

__all__ = ["ResumeCallback", "CheckpointFiles", "MiniMindConsole", "format_minimind_line", "resolve_last"]
