"""Under ``deterministic: true`` (the default; ``--print_config`` shows it: tests/test_precision_resume.py) an op without a deterministic kernel
stops the run at once with one line naming the op and the flag that trades exactness for speed."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.runs import need_shared, run_cli, tiny_args


def test_an_op_without_a_deterministic_kernel_stops_with_one_line(tmp_path: Path) -> None:
    need_shared()
    run = run_cli(tmp_path, tiny_args("--trainer.callbacks+=tests.helpers.nondeterministic_op.NondeterministicOp"))
    assert run.returncode == 2, run.stderr[-3000:]
    assert "Traceback" not in run.stderr
    (line,) = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert "max_unpooling" in line and "--trainer.deterministic false" in line
    assert not run.steps


@pytest.mark.slow
def test_the_flag_it_names_lets_the_run_train(tmp_path: Path) -> None:
    need_shared()
    ok = run_cli(tmp_path, tiny_args("--trainer.callbacks+=tests.helpers.nondeterministic_op.NondeterministicOp",
                                     "--trainer.deterministic", "false"))
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert ok.steps
