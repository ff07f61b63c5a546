"""``python -m lit_minimind.fit`` (and the ``lit-minimind-fit`` script): the entry point of :mod:`lit_minimind.cli.fit`.

Its first lines handle the stop signals, with the standard library only: the imports after them take
seconds (torch, Lightning), and a SIGTERM there would kill the process, a Ctrl-C print a traceback.
:func:`record_stop_signal` only records the signal; :data:`lit_minimind.callbacks.preemption.STOP`
takes it over when installed, and :func:`main` then ends the run before anything is built (exit 0, one
line) or, in a job of several processes, lets it stop where every rank agrees (before the first batch).
"""

import os
import signal
import sys


def record_stop_signal(signum: int, frame: object) -> None:
    """Until ``STOP.install()``: SIGTERM / SIGINT / SIGUSR1 recorded, a second SIGINT aborts (as STOP's)."""
    name = signal.Signals(signum).name
    received = record_stop_signal.stop_signals_received
    if received and name == "SIGINT":
        print("second SIGINT: aborting now, without saving", flush=True)
        os._exit(130)
    received.append(name)


record_stop_signal.stop_signals_received = []  # read by STOP.install (lit_minimind.callbacks.preemption)
record_stop_signal.replaced = {}  # signal number -> the handler before, which STOP.uninstall restores

# the entry point only (python -m, the console script, and the children Lightning's DDP launcher starts
# with the same command line): importing this module from a program changes none of its signals
_ENTRY_POINT = __name__ == "__main__" or os.path.basename(sys.argv[0]) == "lit-minimind-fit"
if _ENTRY_POINT:
    for _name in ("SIGTERM", "SIGINT", "SIGUSR1"):
        if hasattr(signal, _name):
            try:
                record_stop_signal.replaced[getattr(signal, _name)] = signal.signal(getattr(signal, _name),
                                                                                     record_stop_signal)
            except ValueError:  # not the main thread: no handler of ours anywhere
                break


class _NoTorchmetricsPlots:
    """torchmetrics imports ``matplotlib.pyplot`` (and with it ``mpl_toolkits.mplot3d``) when it is imported,
    for the ``.plot()`` of its metrics, whenever matplotlib is installed (the dev extra installs it), with no
    switch of its own (``torchmetrics/utilities/plot.py``: ``if _MATPLOTLIB_AVAILABLE``). Training plots no
    metric: here torchmetrics' ``_MATPLOTLIB_AVAILABLE`` reads False (a ``.plot()`` raises torchmetrics'
    "install matplotlib" error); matplotlib itself stays importable for anything else."""

    name = "torchmetrics.utilities.imports"

    def find_spec(self, name: str, path: object = None, target: object = None) -> object:
        if name != self.name:
            return None
        sys.meta_path.remove(self)  # once
        import importlib.machinery

        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            exec_module = spec.loader.exec_module

            def exec_without_plots(module: object) -> None:
                exec_module(module)
                setattr(module, "_MATPLOTLIB_AVAILABLE", False)

            spec.loader.exec_module = exec_without_plots
        return spec


if _ENTRY_POINT:
    sys.meta_path.insert(0, _NoTorchmetricsPlots())

from lit_minimind.callbacks.preemption import STOP, stops_at_once  # noqa: E402  (seconds: torch, Lightning)
from lit_minimind.cli import leaving  # noqa: E402
from lit_minimind.cli.fit import main as run_cli  # noqa: E402


def main(args: list[str] | None = None) -> int:
    """:func:`lit_minimind.cli.fit.main`, unless a stop signal came during the imports above."""
    STOP.install()  # takes over from record_stop_signal: a signal it recorded is requested now
    if STOP.requested and stops_at_once(STOP.signal_name):
        print(f"stopped by {STOP.signal_name} during start-up; nothing trained, nothing to save", file=sys.stderr,
              flush=True)
        return 0
    code = run_cli(args)  # otherwise a requested stop ends the run before the first batch (ResumeCallback)
    return leaving(code) if _ENTRY_POINT else code


if __name__ == "__main__":
    raise SystemExit(main())
