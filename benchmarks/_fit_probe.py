"""``python -m lit_minimind.fit`` with timestamps: the real CLI, plus ``@@bench`` lines on stdout.

Used by :mod:`benchmarks.bench_resume` to tell where the time to the first trained batch goes.
It wraps (without changing what they do) the jsonl index (scan or cached map), the checkpoint read, the epoch
permutation and the dataset's ``__getitem__`` (counting the samples read), then calls
:func:`lit_minimind.fit.main` with the given arguments. Each line is
``@@bench <event> <time.monotonic()> [samples=<n>]``; ``time.monotonic`` is the system-wide
CLOCK_MONOTONIC, so the parent compares it with its own launch time.
"""

from __future__ import annotations

import sys
import time


def mark(event: str, extra: str = "") -> None:
    print(f"@@bench {event} {time.monotonic():.6f} {extra}".rstrip(), flush=True)


def install() -> None:
    import lit_minimind.data.dataset as dataset
    import lit_minimind.data.sampler as sampler
    import lit_minimind.resume.io as lightning_io
    from lit_minimind.callbacks.console import MiniMindConsole

    def timed(module: object, name: str, event: str) -> None:
        original = getattr(module, name)

        def wrapper(*args, **kwargs):
            mark(f"{event}_start")
            try:
                return original(*args, **kwargs)
            finally:
                mark(f"{event}_end")

        setattr(module, name, wrapper)

    timed(dataset, "record_offsets", "scan")  # JsonlRecords.__init__ calls it by module global (the cached index)
    timed(lightning_io, "read_checkpoint", "ckpt_read")  # read_start_checkpoint, likewise
    timed(sampler, "epoch_permutation", "permutation")  # EpochShardSampler.__iter__, likewise

    reads = [0]
    getitem = dataset.PretrainDataset.__getitem__

    def counting_getitem(self, index):
        if reads[0] == 0:
            mark("first_sample")
        reads[0] += 1
        return getitem(self, index)

    dataset.PretrainDataset.__getitem__ = counting_getitem
    batch_end = MiniMindConsole.on_train_batch_end
    batches = [0]

    def first_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batches[0] == 0:
            mark("first_batch_end", f"samples={reads[0]} batch_idx={batch_idx}")
        batches[0] += 1
        return batch_end(self, trainer, pl_module, outputs, batch, batch_idx)

    MiniMindConsole.on_train_batch_end = first_batch_end


if __name__ == "__main__":
    mark("interpreter_ready")
    import lit_minimind.cli.fit as fit

    mark("imported")
    install()
    sys.exit(fit.main(sys.argv[1:]))
