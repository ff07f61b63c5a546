"""``pip install .`` (a wheel, not editable) works outside a checkout.

The wheel is built from a copy of the source tree (the repository's own tree gets no ``build/``), installed
with ``--no-deps`` into a fresh virtualenv that sees this venv's site-packages (its dependencies: torch,
Lightning, ...) through a ``.pth`` file, never the repository. From an empty directory, with no
``PYTHONPATH``, ``python -m lit_minimind.fit`` must then configure and train as it does from the checkout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.helpers.runs import LINE_RE, ROOT, cli_env

PRESETS = sorted(p.name for p in (ROOT / "conf").glob("*.yaml"))
NOT_SOURCE = shutil.ignore_patterns(".git", ".venv*", "__pycache__", "*.egg-info", "build", "dist", ".cache", ".*_cache",
                                    "out", "checkpoints", "lightning_logs", "wandb", "mutants.json")


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kwargs)
    assert result.returncode == 0, f"{cmd}: exit {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    return result


def _both(*runs: tuple[list[str], Path, dict]) -> list[str]:
    """The stdout of each ``(cmd, cwd, env)``, run side by side (two cores: half the wall time)."""
    procs = [subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for cmd, cwd, env in runs]
    outs = [proc.communicate(timeout=300) for proc in procs]
    for (cmd, _, _), proc, (out, err) in zip(runs, procs, outs):
        assert proc.returncode == 0, f"{cmd}: exit {proc.returncode}\n{out[-2000:]}\n{err[-3000:]}"
    return [out for out, _ in outs]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("install")
    src = tmp / "src"
    shutil.copytree(ROOT, src, symlinks=True, ignore=NOT_SOURCE)  # callbacks/ and conf/ stay links, as in a clone
    build = _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                  "--disable-pip-version-check", "-w", str(tmp / "dist"), str(src)])
    wheel, = (tmp / "dist").glob("lit_minimind-*.whl")
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index",
          "--disable-pip-version-check", str(wheel)])
    # the dependencies: this venv's site-packages (a path line: its .pth files, the editable install's, are not run)
    deps = list(dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib")))
    # (.venv lies in the checkout, but holds no lit_minimind of its own: its install is an editable finder)
    assert all(Path(d).resolve() != ROOT and not (Path(d) / "lit_minimind").exists() for d in deps), deps
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()).resolve()
    (site / "project-deps.pth").write_text("\n".join(deps) + "\n")
    work = tmp / "work"  # empty: no conf/, no lit_minimind/ to import from the cwd
    work.mkdir()
    env = {k: v for k, v in cli_env().items() if k != "PYTHONPATH"}
    return {"build": build.stdout + build.stderr, "wheel": wheel, "venv": venv, "python": str(python), "site": site, "cwd": work, "env": env}


def installed_and_checkout(installed: dict, there: list[str], here: list[str], there_cwd: Path | None = None,
                           here_cwd: Path = ROOT) -> list[str]:
    """The stdout of ``python -m lit_minimind.fit`` with ``there`` installed and with ``here`` from the checkout."""
    return _both(([installed["python"], "-m", "lit_minimind.fit", *there], there_cwd or installed["cwd"], installed["env"]),
                 ([sys.executable, "-m", "lit_minimind.fit", *here], here_cwd, cli_env()))


def test_the_wheel_holds_the_package_and_its_configs(installed: dict) -> None:
    names = zipfile.ZipFile(installed["wheel"]).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"lit_minimind", "lit_minimind-0.1.0.dist-info"}, tops  # no callbacks, conf, tests, benchmarks
    pipelines = {f"lit_minimind/conf/pipeline/{p.name}" for p in (ROOT / "lit_minimind" / "conf" / "pipeline").glob("*.yaml")}
    assert {n for n in names if n.startswith("lit_minimind/conf/")} == {f"lit_minimind/conf/{p}" for p in PRESETS} | pipelines
    assert "lit_minimind/conf/pipeline/default.yaml" in pipelines
    assert "lit_minimind/data/agent_rl.jsonl" in names  # agent RL's demo data
    assert "default.yaml" in PRESETS and "minimind_pretrain.yaml" in PRESETS
    assert "lit_minimind/callbacks/__init__.py" in names and not any("__pycache__" in n for n in names)


def test_the_build_is_clean(installed: dict) -> None:
    """No setuptools deprecation (``project.license`` as a TOML table: "By 2027-Feb-18, ... your builds will no
    longer be supported"): the license is an SPDX expression, in the wheel's metadata as such."""
    assert "license" not in installed["build"].lower() and "deprecat" not in installed["build"].lower(), installed["build"]
    metadata = zipfile.ZipFile(installed["wheel"]).read("lit_minimind-0.1.0.dist-info/METADATA").decode()
    assert "\nLicense-Expression: Apache-2.0\n" in metadata, metadata[:1000]


def test_it_imports_the_installed_package_and_its_presets(installed: dict) -> None:
    probe = _run([installed["python"], "-c", "import sys, lit_minimind.cli.presets as p, importlib.util as u; "
                  "print(p.__file__); print(p.DEFAULT_CONFIG); print(','.join(p.preset_names())); "
                  "print(u.find_spec('callbacks'), u.find_spec('conf')); print(*sys.path, sep='\\n')"],
                 cwd=installed["cwd"], env=installed["env"]).stdout.splitlines()
    module, default, names, tops, *path = probe
    assert Path(module).resolve().is_relative_to(installed["site"]) and Path(default).is_relative_to(installed["site"]), probe
    assert names.split(",") == [p.removesuffix(".yaml") for p in PRESETS]
    assert tops == "None None", tops  # the checkout's top-level links are not importable
    assert not any(Path(p).resolve() == ROOT for p in path if p), path


def test_the_upload_process_imports_the_installed_package(installed: dict) -> None:
    """The checkpoint uploader's child (``python -m lit_minimind.resume.upload``) starts from the install
    alone: no repository path is put on its ``PYTHONPATH``. It exits 0 once its stdin closes."""
    run = _run([installed["python"], "-c", "from lit_minimind.resume.upload import Uploader; u = Uploader('s3://b/p'); "
                "u.start(); u._proc.stdin.close(); print('exit', u._proc.wait(60))"], cwd=installed["cwd"], env=installed["env"])
    assert run.stdout.strip() == "exit 0" and "Error" not in run.stderr, (run.stdout, run.stderr[-2000:])


@pytest.mark.parametrize("installed_args, checkout_args", [
    ([], []),
    (["--config", "minimind_pretrain"], ["--config", "conf/minimind_pretrain.yaml"]),
], ids=["default", "pretrain_by_name"])
def test_print_config_as_from_the_checkout(installed: dict, installed_args: list[str], checkout_args: list[str]) -> None:
    there, here = installed_and_checkout(installed, [*installed_args, "--print_config"], [*checkout_args, "--print_config"])
    assert there == here
    if not installed_args:  # the embedded default, not the classes' defaults (768, no max_epochs)
        assert "  hidden_size: 128\n" in there and "  max_epochs: 3\n" in there and "  deterministic: true\n" in there


def test_unknown_preset_from_the_entry_point(installed: dict) -> None:
    run = subprocess.run([str(installed["venv"] / "bin" / "lit-minimind-fit"), "--config", "nope"], cwd=installed["cwd"],
                         env=installed["env"], capture_output=True, text=True, timeout=120)
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert run.returncode == 2 and len(lines) == 1, run.stderr[-2000:]
    assert lines[0].startswith("error: --config nope: ") and all(p.removesuffix(".yaml") in lines[0] for p in PRESETS)


@pytest.mark.slow  # two 3-step runs side by side: ~25 s on a loaded 2-core machine (the configs are compared above)
def test_trains_the_embedded_default_as_from_the_checkout(installed: dict, tmp_path: Path) -> None:
    args = ["--trainer.max_steps", "3", "--log_interval", "1", "--trainer.enable_progress_bar", "false"]
    for where in ("installed", "checkout"):
        (tmp_path / where).mkdir()
    outs = installed_and_checkout(installed, args, args, tmp_path / "installed", tmp_path / "checkout")
    losses = [[m[:8] for m in LINE_RE.findall(out)] for out in outs]  # all but the epoch time
    assert len(losses[0]) == 3 and losses[0] == losses[1], losses
    assert (tmp_path / "installed" / "out" / "pretrain_128.pth").is_file()  # the default's hidden_size 128
    assert sorted(os.listdir(tmp_path / "installed")) == sorted(os.listdir(tmp_path / "checkout"))
