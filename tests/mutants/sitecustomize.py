"""Deliberate breaks of the product, applied from outside it at interpreter start-up.

``LIT_MINIMIND_MUTANT=<name>`` (with this directory first on ``PYTHONPATH``, which
``tests/helpers/runs.py:cli_env`` passes on to every process a test starts) patches one behaviour
when the module holding it is imported. ``make test-mutants`` (scripts/mutants.py) requires the
suite to catch each. Every applied patch appends ``<mutant> <pid> <what>`` to
``LIT_MINIMIND_MUTANT_LOG`` (if set), so a mutant that no longer applies is noticed.
"""

from __future__ import annotations

import functools
import importlib.abc
import os
import sys
from collections.abc import Callable
from typing import Any

MUTANT = os.environ.get("LIT_MINIMIND_MUTANT", "")


def _applied(what: str) -> None:
    log = os.environ.get("LIT_MINIMIND_MUTANT_LOG")
    if log:
        with open(log, "a") as f:
            f.write(f"{MUTANT} {os.getpid()} {what}\n")


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


# ---------------------------------------------------------------- the mutants: module -> patch
def _drop_ckpt_path(module: Any) -> None:
    """Resume starts fresh: Trainer.fit never sees a ckpt_path."""
    fit = module.Trainer.fit

    @functools.wraps(fit)
    def fit_fresh(self: Any, *args: Any, **kwargs: Any) -> Any:
        if len(args) >= 4:
            args = args[:3] + (None,) + args[4:]
        if kwargs.get("ckpt_path") is not None:
            _applied(f"dropped ckpt_path={kwargs['ckpt_path']}")
        kwargs["ckpt_path"] = None
        return fit(self, *args, **kwargs)

    module.Trainer.fit = fit_fresh


def _patch_method(class_has: str, method: str, make: Callable[[Any], Any]) -> Callable[[Any], None]:
    """Patch ``method`` of every class in a project module that defines it (found by name: layout-proof)."""

    def patch(module: Any) -> None:
        for obj in list(vars(module).values()):
            if isinstance(obj, type) and obj.__module__ == module.__name__ and method in vars(obj) and class_has in vars(obj):
                raw = vars(obj)[method]
                setattr(obj, method, make(raw))
                _applied(f"{obj.__qualname__}.{method}")

    return patch


def _patch_function(name: str, replacement: Callable[..., Any]) -> Callable[[Any], None]:
    """Replace the code of the project function ``name`` where it is defined (so every importer sees it)."""

    def patch(module: Any) -> None:
        fn = vars(module).get(name)
        if callable(fn) and getattr(fn, "__module__", None) == module.__name__ and hasattr(fn, "__code__"):
            fn.__code__ = replacement.__code__
            _applied(f"{module.__name__}.{name}")

    return patch


def _no_skip(raw: Any) -> Any:
    return _noop  # ResumableBatchSampler.resume_at: the data position is never skipped


def _every_batch_steps(step: int, iters: int, accumulate: int) -> bool:
    return True  # position.window_complete: saves are no longer held to the accumulation window's end


def _class_noop(module: Any, cls_name: str, method: str) -> None:
    setattr(getattr(module, cls_name), method, _noop)
    _applied(f"{cls_name}.{method}")


PROJECT = ("lit_minimind",)
MUTANTS: dict[str, list[tuple[tuple[str, ...], Callable[[Any], None]]]] = {
    # name: [(modules whose import triggers the patch (exact name, or a prefix ending in "."), patch)]
    "resume_fresh": [(("lightning.pytorch.trainer.trainer",), _drop_ckpt_path)],
    "data_not_skipped": [(("lit_minimind.",), _patch_method("__iter__", "resume_at", _no_skip))],
    "optimizer_not_restored": [(("torch.optim.optimizer",), lambda m: _class_noop(m, "Optimizer", "load_state_dict"))],
    "save_mid_window": [(("lit_minimind.",), _patch_function("window_complete", _every_batch_steps))],
    "scaler_not_restored": [(("torch.amp.grad_scaler",), lambda m: _class_noop(m, "GradScaler", "load_state_dict"))],
    "rng_not_restored": [(("lit_minimind.",), _patch_function("set_rng_state", _noop))],
    "wandb_id_not_passed": [(("lit_minimind.",), _patch_function("continue_wandb_run", _noop))],
}


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs the mutant's patches right after a matching module is executed."""

    def __init__(self, patches: list[tuple[tuple[str, ...], Callable[[Any], None]]]) -> None:
        self.patches = patches
        self.busy: set[str] = set()

    def _matching(self, name: str) -> list[Callable[[Any], None]]:
        return [patch for names, patch in self.patches
                if any(name == n or (n.endswith(".") and name.startswith(n)) for n in names)]

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        patches = self._matching(name)
        if not patches or name in self.busy:
            return None
        self.busy.add(name)
        try:
            import importlib.util

            spec = importlib.util.find_spec(name)
        finally:
            self.busy.discard(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        original = spec.loader.exec_module  # this module's own loader object: patched on the instance

        def exec_module(module: Any) -> None:
            original(module)
            for patch in patches:
                patch(module)

        spec.loader.exec_module = exec_module
        return spec


def _run_the_next_sitecustomize() -> None:
    """Python imports one ``sitecustomize``: run the next one on ``sys.path`` too (the tests' fault
    injection, tests/helpers/site), as if this one were not there."""
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        candidate = os.path.join(os.path.abspath(entry or "."), "sitecustomize.py")
        if os.path.dirname(candidate) != here and os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_next_sitecustomize", candidate)
            if spec is not None and spec.loader is not None:
                spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


if MUTANT:
    if MUTANT not in MUTANTS:
        raise SystemExit(f"LIT_MINIMIND_MUTANT={MUTANT}: unknown (known: {', '.join(MUTANTS)})")
    sys.meta_path.insert(0, _AfterImport(MUTANTS[MUTANT]))  # first: the next one may import the project

_run_the_next_sitecustomize()
