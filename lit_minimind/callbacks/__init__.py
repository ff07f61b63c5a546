"""lit-minimind's Lightning callbacks."""

from lit_minimind.callbacks.console import MiniMindConsole, format_minimind_line
from lit_minimind.callbacks.progress import MiniMindProgressBar
from lit_minimind.callbacks.quiet import hide_harmless_noise
from lit_minimind.callbacks.resume import ResumeCallback
from lit_minimind.resume.internals import MiniMindSummary
from lit_minimind.resume.manager import CheckpointFiles
from lit_minimind.resume.start import resolve_last

__all__ = ["ResumeCallback", "CheckpointFiles", "MiniMindConsole", "MiniMindProgressBar", "MiniMindSummary",
           "format_minimind_line", "hide_harmless_noise", "resolve_last"]
