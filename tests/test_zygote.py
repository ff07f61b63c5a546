"""The tests' forked runs (tests/helpers/zygote.py) behave as launched ones: a forked run prints and saves what
``python -m lit_minimind.fit`` started afresh prints and saves, but for what two fresh launches differ in too
(wall-clock figures, the random run id), and two runs one after the other hash strings differently, as two launched
Pythons do."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import zygote
from tests.helpers.runs import cli_env, need_shared, run_cli, tiny_args

RUN_ID = re.compile(r"_[0-9a-f]{8}(?=\.ckpt$)")
TIMINGS = re.compile(r"\d+\.\d+ s|[\d,]+ tokens/s|epoch_time: [\d.]+min")  # wall-clock figures
# imported by the run as it parses its flags (--trainer.callbacks+=hash_probe.Probe, from the run's cwd): it prints
# the run's hash of a string and ends the run there
HASH_PROBE = 'import os\nprint("hash", hash("x"), flush=True)\nos._exit(0)\n'


def leaves(obj: object, path: str = "") -> dict[str, object]:
    """Every value of a loaded checkpoint by its path (``.callbacks.ResumeCallback.run_id``, ...)."""
    if isinstance(obj, dict):
        return {k: v for key, value in obj.items() for k, v in leaves(value, f"{path}.{key}").items()}
    if isinstance(obj, (list, tuple)):
        return {k: v for i, value in enumerate(obj) for k, v in leaves(value, f"{path}[{i}]").items()}
    return {path: obj}


def same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return type(a) is type(b) and a == b


def saved(run_dir: Path) -> dict[str, dict[str, object]]:
    """Each checkpoint and export of a run (a checkpoint's run id left out of its name), loaded, as leaves."""
    return {RUN_ID.sub("", str(p.relative_to(run_dir))): leaves(torch.load(p, map_location="cpu", weights_only=False))
            for p in sorted(run_dir.rglob("*")) if p.is_file() and p.suffix in (".pth", ".ckpt")}


def test_a_forked_run_prints_and_saves_what_a_launched_one_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    need_shared()
    if os.environ.get("LIT_MINIMIND_MUTANT"):
        pytest.skip("a mutant run launches every run (its patches apply at interpreter start)")
    args = tiny_args("--trainer.max_steps", "4", "--model.dropout", "0.1")  # dropout: the RNG streams count too
    runs, files = {}, {}
    for how in ("forked", "launched", "launched again"):
        monkeypatch.setenv("LIT_MINIMIND_FORK", "1" if how == "forked" else "0")
        run_dir = tmp_path / how
        run_dir.mkdir()
        if how == "forked":  # both zygotes of this environment serve (its runs alternate between them)
            for _ in range(2):
                probe = zygote.start(["--help"], run_dir, cli_env())
                assert probe is not None, "no zygote served the run"
                assert "--resume.save_interval" in probe.stdout.read() and probe.wait(60) == 0
        runs[how] = run_cli(run_dir, args)
        assert runs[how].returncode == 0, runs[how].stderr[-2000:]
        files[how] = saved(run_dir)
    forked, launched = runs["forked"], runs["launched"]
    assert forked.lines and TIMINGS.sub("", forked.stdout) == TIMINGS.sub("", launched.stdout)
    assert TIMINGS.sub("", forked.stderr) == TIMINGS.sub("", launched.stderr)
    assert files["forked"].keys() == files["launched"].keys() == files["launched again"].keys()
    assert {"out/pretrain_64.pth", "checkpoints/pretrain_64_resume.pth"} <= files["forked"].keys()
    compared = 0
    for name, values in files["launched"].items():
        assert values.keys() == files["forked"][name].keys(), name
        for key, value in values.items():
            if same(value, files["launched again"][name][key]):  # not a per-run value
                assert same(files["forked"][name][key], value), f"{name}: {key} differs from a launched run's"
                compared += 1
    assert compared > 100  # the weights, the optimizer's moments, the RNG states, the positions, ...


def test_runs_one_after_the_other_hash_strings_differently(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh Python draws its string-hash seed at start, a fork keeps its zygote's: the runs of one environment
    alternate between two zygotes of different seeds, so a run and the next (an interrupted run and its resume)
    see different hashes, and code that depends on hash order across processes shows; an environment's own
    PYTHONHASHSEED holds in every run, as in a launched one."""
    if os.environ.get("LIT_MINIMIND_MUTANT"):
        pytest.skip("a mutant run launches every run (its patches apply at interpreter start)")
    monkeypatch.setenv("LIT_MINIMIND_FORK", "1")
    (tmp_path / "hash_probe.py").write_text(HASH_PROBE)

    def hashes(env: dict[str, str]) -> list[int]:
        seen = []
        for _ in range(3):
            run = zygote.start(["--trainer.callbacks+=hash_probe.Probe"], tmp_path, env)
            assert run is not None, "no zygote served the run"
            out, err = run.stdout.read(), run.stderr.read()
            assert run.wait(60) == 0, err[-2000:]
            printed = re.search(r"^hash (-?\d+)$", out, re.M)
            assert printed is not None, out[-2000:] + err[-2000:]
            seen.append(int(printed[1]))
        return seen

    env = {k: v for k, v in cli_env().items() if k != "PYTHONHASHSEED"}  # also when the suite runs with one
    first, second, third = hashes(env)
    assert first != second and second != third, "two forked runs one after the other hashed strings alike"
    fixed = hashes({**env, "PYTHONHASHSEED": "123"})
    launched = subprocess.run([sys.executable, "-c", 'print(hash("x"))'], env={**env, "PYTHONHASHSEED": "123"},
                              capture_output=True, text=True, timeout=60, check=True)
    assert fixed == [int(launched.stdout)] * 3
