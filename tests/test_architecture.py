"""The architecture page (docs/architecture.md) cannot drift from the code: the files of the save path and of the
restore path are computed here from the import graph and must be the lists the page gives, and the resume core stays
within its size (save path <= 8 files, ``ResumeCallback`` <= 150 lines).

The save path is the top-level import closure of :mod:`lit_minimind.resume.manager` (the manager's one save:
what a checkpoint write can reach). The restore path adds what the manager's load entry points import when
they are called (:mod:`lit_minimind.resume.start`, the reader) and their closure. Imports made only for a URL
directory (:mod:`lit_minimind.resume.remote`) or a Hugging Face directory are not on the local paths; model
and data code (the module's and DataModule's own ``state_dict``) are not counted."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.helpers.runs import ROOT
from tests.test_layers import imports, modules

MANAGER = "lit_minimind.resume.manager"
LOAD_ENTRIES = ("choose", "last", "prepare", "restore", "republish")  # CheckpointManager's load side
URL_ONLY = {"lit_minimind.resume.remote"}  # imported only for a URL checkpoint directory


def closure(start: set[str]) -> set[str]:
    seen: set[str] = set()
    todo = list(start)
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += imports(modules()[module], top_level_only=True)
    return seen


def imported_inside(module: str, cls: str, methods: tuple[str, ...]) -> set[str]:
    """Project modules imported inside ``cls.methods`` of ``module`` (imports made when the method runs)."""
    tree = ast.parse(modules()[module].read_text())
    known = modules()
    found: set[str] = set()
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
    for fn in (n for n in body if isinstance(n, ast.FunctionDef) and n.name in methods):
        for node in ast.walk(fn):
            if isinstance(node, ast.ImportFrom) and node.module in known:
                found.add(node.module)
    return found


def files(mods: set[str]) -> list[str]:
    counted = {m for m in mods if not m.startswith(("lit_minimind.model", "lit_minimind.data"))}
    paths = [modules()[m].relative_to(ROOT / "lit_minimind").as_posix() for m in counted]
    return sorted(p for p in paths if not p.endswith("__init__.py"))


def save_path() -> list[str]:
    return files(closure({MANAGER}))


def restore_path() -> list[str]:
    return files(closure({MANAGER} | imported_inside(MANAGER, "CheckpointManager", LOAD_ENTRIES)))


def readme_list(label: str) -> tuple[int, list[str]]:
    match = re.search(rf"^{label} \((\d+) files\): (.*)$", (ROOT / "docs" / "architecture.md").read_text(), re.M)
    assert match, f"docs/architecture.md has no line '{label} (N files): ...'"
    return int(match.group(1)), re.findall(r"`([^`]+)`", match.group(2))


def test_the_docs_list_the_save_and_restore_paths_the_code_has() -> None:
    for label, computed in (("Save path", save_path()), ("Restore path", restore_path())):
        count, listed = readme_list(label)
        assert sorted(listed) == computed, f"{label}: the docs list {listed}, the code has {computed}"
        assert count == len(computed), f"{label}: the docs say {count} files, the code has {len(computed)}"


def test_the_resume_core_stays_small() -> None:
    assert len(save_path()) <= 8, save_path()
    assert "checkpoint/read.py" not in save_path() and "resume/start.py" not in save_path()  # a save never reads
    assert not URL_ONLY & closure({MANAGER} | imported_inside(MANAGER, "CheckpointManager", LOAD_ENTRIES)), \
        "a local restore imports the remote code"
    tree = ast.parse((ROOT / "lit_minimind" / "callbacks" / "resume.py").read_text())
    callback = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ResumeCallback")
    assert callback.end_lineno - callback.lineno + 1 <= 150


def test_lightning_internals_are_named_in_one_module() -> None:
    """Lightning's private names and loop counters appear only in resume/internals.py (each with why)."""
    private = re.compile(r"batch_progress|_find_last_checkpoints|_batches_that_stepped|optim_progress|"
                         r"_flush_logs_every_n_steps|__qualname__\]")
    found = [f"{path.relative_to(ROOT)}:{n}" for path in sorted((ROOT / "lit_minimind").rglob("*.py"))
             if path.name != "internals.py"
             for n, line in enumerate(path.read_text().splitlines(), 1) if private.search(line)]
    assert not found, found


def test_a_new_part_is_one_class_and_one_registration(tmp_path: Path) -> None:
    """What the manager's docstring promises for PPO's critic: a part registered under a name is saved with the
    checkpoint's callback state and given back on load."""
    from lit_minimind.resume.manager import CheckpointManager

    class Counter:
        def __init__(self) -> None:
            self.n = 0

        def state_dict(self) -> int:
            return self.n

        def load_state_dict(self, state: int | None) -> None:
            self.n = state or 0

    saving, loading = CheckpointManager(ckpt_dir=str(tmp_path)), CheckpointManager(ckpt_dir=str(tmp_path))
    saving.register("counter", Counter())
    saving.parts["counter"].n = 7
    loading.register("counter", Counter())
    state = saving.state_dict()
    assert {"run_id", "wandb_id", "best_val_loss", "resume_records", "format", "versions", "counter"} <= set(state)
    loading.load_state_dict(state)
    assert loading.parts["counter"].n == 7 and loading.run.value == saving.run.value


def test_the_file_operations_are_passed_to_the_writers_not_switched_globally(tmp_path: Path) -> None:
    """A ``FileOps`` given to the manager is the one its checkpoint, MiniMind's link and the export are committed
    through (no module-global to switch: the tests' faults are a ``FileOps`` too)."""
    from types import SimpleNamespace

    import torch
    from lightning.fabric.plugins import TorchCheckpointIO

    from lit_minimind.checkpoint import atomic
    from lit_minimind.checkpoint.names import CheckpointName
    from lit_minimind.resume.io import SafeCheckpointIO
    from lit_minimind.resume.manager import CheckpointManager

    assert not [name for name, value in vars(atomic).items() if isinstance(value, atomic.FileOps)]

    class Recording(atomic.FileOps):
        def __init__(self) -> None:
            self.committed: list[str] = []

        def replace(self, tmp: Path, target: Path) -> None:
            self.committed.append(target.name)
            super().replace(tmp, target)

    ops = Recording()
    manager = CheckpointManager(ckpt_dir=str(tmp_path / "ckpt"), out_dir=str(tmp_path / "out"), ops=ops)
    checkpoint = manager.files.checkpoint(CheckpointName("pretrain_64", 0, 1, 1, manager.run.value))
    trainer = SimpleNamespace(strategy=SimpleNamespace(checkpoint_io=TorchCheckpointIO()), datamodule=None)
    io = manager.install_io(trainer)  # Lightning's default CheckpointIO replaced, as at setup
    assert isinstance(io, SafeCheckpointIO) and trainer.strategy.checkpoint_io is io
    io.save_checkpoint({"state_dict": {}}, checkpoint)
    io.wait()
    manager.files.publish(checkpoint, "pretrain_64", {"w": torch.zeros(2, dtype=torch.float16)})
    data = [name for name in ops.committed if not name.endswith(".manifest.json")]
    assert data == [checkpoint.name, "pretrain_64_resume.pth", "pretrain_64.pth"], ops.committed
    assert len(ops.committed) == 6  # each with its manifest
