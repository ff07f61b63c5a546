"""The server's continuous batching: one decoding thread, one forward per token for every active request.

Handler threads :meth:`Engine.submit` a :class:`Job` (prompt ids, sampling settings, its own ``torch.Generator``)
and read its tokens from the job as they come. The engine's thread loops: admit waiting jobs (FIFO, up to
``max_batch`` active) with their prefill, then one :func:`~lit_minimind.model.batched.decode_step` for all active
jobs, each then drawing its next token from its own logits row with its own generator. A job joins and leaves
between two tokens, so its tokens are exactly those :func:`~lit_minimind.model.minimind.sample_tokens` yields
for it alone (``lit_minimind.model.batched`` says why the rows are bit-exact).

The engine never waits on a client: a token is appended to the job's queue (at most ``max_tokens`` of them),
and a handler that cannot write (a stalled reader) or whose client left cancels its job, which leaves the
batch at the next token. A job past its deadline leaves too (``finish`` ``"deadline"``).
"""

from __future__ import annotations

import queue
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator, List

import torch

from lit_minimind.model import MiniMindForCausalLM
from lit_minimind.model.batched import Cache, decode_step, exact_rows, prefill
from lit_minimind.model.minimind import pick_next_token

__all__ = ["Engine", "Job"]


@dataclass(eq=False)
class Job:
    """One request's decoding: its settings, its state in the batch, and the queue its handler reads."""

    ids: List[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    eos: int | None = 2
    generator: torch.Generator = field(default_factory=torch.Generator)
    deadline: float = float("inf")  # time.monotonic() after which it stops
    out: "queue.SimpleQueue[int | tuple[str, str]]" = field(default_factory=queue.SimpleQueue)
    cancelled: bool = False
    admitted: threading.Event = field(default_factory=threading.Event)
    produced: int = 0
    cache: Cache | None = None
    last: int = 0

    def cancel(self) -> None:
        """Leave the batch at the next token (the client went away or cannot keep up)."""
        self.cancelled = True

    def tokens(self, poll: float = 0.5) -> Iterator[int | None]:
        """Its tokens as they come; ``None`` every ``poll`` seconds without one (the caller checks its client);
        ends with ``self.finish``: ``"stop"`` (EOS), ``"length"``, ``"deadline"``, ``"cancelled"`` or ``"error"``."""
        while True:
            try:
                item = self.out.get(timeout=poll)
            except queue.Empty:
                yield None
                continue
            if isinstance(item, tuple):
                self.finish = item[1]
                return
            yield item

    def _emit(self, token: int) -> bool:
        """Record a drawn token; whether the job goes on."""
        if token == self.eos:
            return self._end("stop")
        self.out.put(token)
        self.produced += 1
        self.last = token
        return self.produced < self.max_tokens or self._end("length")

    def _end(self, reason: str) -> bool:
        self.cache = None  # its memory goes now, not when the handler lets go of the job
        self.out.put(("finish", reason))
        return False


class Engine:
    """The decoding thread (started by :meth:`start`) and its FIFO of waiting jobs."""

    def __init__(self, model: MiniMindForCausalLM, max_batch: int = 16) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self.model, self.max_batch = model, max_batch
        self.linear = exact_rows(model, max_batch)
        self.waiting: deque[Job] = deque()
        self.active: list[Job] = []
        self.joining: list[Job] = []  # admitted, not yet prefilled
        self.cond = threading.Condition()
        self.steps = 0  # decode steps run (for tests and logs)
        self.thread = threading.Thread(target=self._run, name="decoder", daemon=True)

    def start(self) -> "Engine":
        self.thread.start()
        return self

    def submit(self, job: Job) -> Job:
        with self.cond:
            self.waiting.append(job)
            self.cond.notify()
        return job

    @property
    def load(self) -> tuple[int, int]:
        """(active, waiting) jobs."""
        return len(self.active), len(self.waiting)

    def _admit(self) -> list[Job]:
        with self.cond:
            self.cond.wait_for(lambda: self.waiting or self.active)
            joined = []
            while self.waiting and len(self.active) + len(joined) < self.max_batch:
                joined.append(self.waiting.popleft())
            return joined

    def _draw(self, job: Job, logits: torch.Tensor, greedy: int | None = None) -> bool:
        """The job's next token from its logits row ``(1, vocab)`` with its own generator (``greedy``: the row's
        argmax, already taken for the whole batch at once: ``pick_next_token`` at temperature 0 is that argmax)."""
        if greedy is not None and job.temperature == 0:
            return job._emit(greedy)
        token = pick_next_token(logits, job.temperature, job.top_p, job.top_k, job.generator)
        return job._emit(int(token))

    def _live(self, job: Job, now: float) -> bool:
        if job.cancelled:
            return job._end("cancelled")
        if now > job.deadline:
            return job._end("deadline")
        return True

    def _run(self) -> None:
        while True:
            try:
                self._step()
            except Exception:  # a bug: every job in flight ends with an error, the engine goes on
                traceback.print_exc(file=sys.stderr)
                for job in self.active + self.joining:
                    job._end("error")
                self.active, self.joining = [], []

    def _step(self) -> None:
        self.joining = self._admit()
        while self.joining:
            job = self.joining[0]
            job.admitted.set()
            if self._live(job, time.monotonic()):
                job.cache, logits = prefill(self.model, job.ids)
                if self._draw(job, logits):
                    self.active.append(job)
            self.joining.pop(0)
        now = time.monotonic()
        self.active = [job for job in self.active if self._live(job, now)]
        if not self.active:
            return
        logits = decode_step(self.model, [job.cache for job in self.active], [job.last for job in self.active],
                             self.linear)
        self.steps += 1
        argmax = logits.argmax(dim=-1).tolist()
        self.active = [job for i, job in enumerate(self.active) if self._draw(job, logits[i:i + 1], argmax[i])]
