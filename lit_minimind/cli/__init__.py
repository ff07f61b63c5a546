"""The command line: fit, MiniMind's flags, validation, generate, inspect (the only importer of ``callbacks``)."""

import gc


def leaving(code: int) -> int:
    """A command's exit code, once the process is about to end: the garbage collected once (finalizers run, files
    flush), then what is left frozen, so that the interpreter's teardown does not walk torch's and Lightning's
    objects again in its own collections (``import torch, lightning`` alone takes 0.9 s to exit, 0.13 s frozen:
    docs/several-machines.md, "Exit time"). Called by the entry points only (``python -m lit_minimind.*``, ``lit-minimind-fit``)."""
    gc.collect()
    gc.freeze()
    return code
