"""``python -m lit_minimind.fit`` with each save timed: the real CLI, plus ``@@save <seconds>`` lines on stdout.

Used by :mod:`benchmarks.bench_remote`: it wraps (without changing what it does) ``ResumeCallback.save``,
the call the training loop blocks in for a save, then calls :func:`lit_minimind.cli.fit.main`.
"""

from __future__ import annotations

import sys
import time

if __name__ == "__main__":
    import lit_minimind.cli.fit as fit
    from lit_minimind.callbacks.resume import ResumeCallback

    save = ResumeCallback.save

    def timed_save(self, trainer, pl_module):
        start = time.perf_counter()
        try:
            return save(self, trainer, pl_module)
        finally:
            print(f"@@save {time.perf_counter() - start:.6f}", flush=True)

    ResumeCallback.save = timed_save
    sys.exit(fit.main(sys.argv[1:]))
