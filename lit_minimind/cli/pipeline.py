"""``python -m lit_minimind.pipeline [--config FILE] [--run_dir DIR]``: the whole pipeline as one resumable run.

One YAML config (default ``conf/pipeline/default.yaml``) names the stages and each stage's flags: MiniMind's tokenizer
(optional), then each ``python -m lit_minimind.fit`` stage (pretrain, SFT, DPO, reward model, GRPO, PPO, agent RL, distillation),
then the evaluation and the report card. Each runs as a child process in the run directory (so its files keep
MiniMind's names: ``out/``, ``checkpoints/``), its output shown and appended to ``logs/<step>.log``, and
``pipeline.json`` records which steps finished, their commands, attempts and wall times, and the config's digest.

Killed anywhere, the same command continues: a finished step is skipped, an unfinished one runs again with the
same command (a fit stage with ``--ckpt_path last``: it resumes from its own last checkpoint, exactly), so every
stage's outputs equal an uninterrupted pipeline's. SIGTERM / SIGINT / SIGUSR1 are passed to the running stage
(which saves and stops) and the pipeline exits non-zero (128 + the signal). A changed config is refused in one
line naming the step and the key that changed.
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import hashlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lit_minimind.cli.plain import description

CONF_DIR = Path(__file__).resolve().parents[1] / "conf" / "pipeline"  # not conf/*.yaml: those are fit's presets
DEFAULT_CONFIG = CONF_DIR / "default.yaml"
DEFAULT_RUN_DIR = "runs/pipeline"
RECORD = "pipeline.json"
RECORD_VERSION = 1
STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1")
STAGE_KEYS = {"weights", "args", "chat", "evaluate"}
TOP_KEYS = {"tokenizer", "fit_args", "stages", "evaluation"}
# a fit stage that stopped early although it exited 0: a stop signal, or one during its start-up
STOPPED = re.compile(r"^stopped by \S+|during start-up; nothing trained", re.M)
LOGS = re.compile(r"^logs: (\S+)", re.M)
RESUMED = re.compile(r"resuming epoch (\d+) at step (\d+)/\d+|resuming at the start of epoch (\d+)")


class ConfigError(ValueError):
    """A config the pipeline cannot run, or one that differs from the run directory's: one line."""


@dataclass
class Step:
    """One child process of the pipeline: its name (``pretrain``, ``evaluation``, ...) and its argv after the Python."""

    name: str
    argv: list[str]
    kind: str  # tokenizer | fit | evaluation | report
    settings: dict[str, Any] = field(default_factory=dict)  # what the record compares: the step's flags by key

    def command(self, python: str) -> str:
        return shlex.join([python, *self.argv])


# ----------------------------------------------------------------------------------------------- the config


def load_config(path: str | os.PathLike[str] | None) -> dict[str, Any]:
    """The YAML config at ``path`` (a file, or a name in ``conf/pipeline/``: ``minimind``), checked."""
    import yaml

    p = Path(path) if path else DEFAULT_CONFIG
    if path and not p.is_file() and (CONF_DIR / f"{path}.yaml").is_file():
        p = CONF_DIR / f"{path}.yaml"
    try:
        config = yaml.safe_load(p.read_text())
    except OSError as err:
        raise ConfigError(f"--config {path}: {err.strerror or err}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"--config {p}: not YAML ({' '.join(str(err).split())})") from None
    return check_config(config, p)


def check_config(config: Any, where: str | os.PathLike[str] = "config") -> dict[str, Any]:
    if not isinstance(config, dict) or not isinstance(config.get("stages"), dict) or not config["stages"]:
        raise ConfigError(f"{where}: needs a mapping 'stages:' naming at least one stage")
    unknown = set(config) - TOP_KEYS
    if unknown:
        raise ConfigError(f"{where}: unknown key {sorted(unknown)[0]!r} (known: {', '.join(sorted(TOP_KEYS))})")
    for name, stage in config["stages"].items():
        if not isinstance(stage, dict) or not isinstance(stage.get("args", {}), dict):
            raise ConfigError(f"{where}: stage {name}: needs a mapping with 'args:' (a mapping of fit flags)")
        if set(stage) - STAGE_KEYS:
            raise ConfigError(f"{where}: stage {name}: unknown key {sorted(set(stage) - STAGE_KEYS)[0]!r} "
                              f"(known: {', '.join(sorted(STAGE_KEYS))})")
        if name in ("tokenizer", "evaluation", "report"):
            raise ConfigError(f"{where}: stage {name}: that name is the pipeline's own step; call the stage otherwise")
    for section in ("tokenizer", "evaluation", "fit_args"):
        if not isinstance(config.get(section) or {}, dict):
            raise ConfigError(f"{where}: '{section}:' must be a mapping")
    return config


def flag_value(value: Any) -> str:
    """A YAML value as the command line writes it (YAML's ``true``: ``true``; ``null``: ``null``)."""
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "null"
    return str(value)


def plan(config: dict[str, Any]) -> list[Step]:
    """The steps the config asks for, in order, each with its exact argv."""
    steps: list[Step] = []
    tokenizer = config.get("tokenizer") or {}
    tokenizer_dir = None
    if tokenizer.get("enabled"):
        tokenizer_dir = str(tokenizer.get("out_dir") or "tokenizer")
        data = tokenizer.get("data")
        argv = ["-m", "lit_minimind.train_tokenizer", str(data) if data else "{embedded corpus}", "--out_dir", tokenizer_dir]
        if tokenizer.get("vocab_size") is not None:
            argv += ["--vocab_size", str(tokenizer["vocab_size"])]
        steps.append(Step("tokenizer", argv, "tokenizer", {"data": data, "out_dir": tokenizer_dir,
                                                             "vocab_size": tokenizer.get("vocab_size")}))
    common = config.get("fit_args") or {}
    for name, stage in config["stages"].items():
        flags = {**common, **(stage.get("args") or {})}
        if tokenizer_dir is not None:
            flags.setdefault("data.tokenizer_path", tokenizer_dir)
        flags.pop("ckpt_path", None)  # the pipeline's own: every fit stage resumes its own last checkpoint
        if "config" in flags:  # a fit preset first: the flags after it override it
            flags = {"config": flags.pop("config"), **flags}
        argv = ["-m", "lit_minimind.fit"]
        for key, value in flags.items():
            argv += [f"--{key}", flag_value(value)]
        argv += ["--ckpt_path", "last"]
        settings = {f"--{k}": flag_value(v) for k, v in flags.items()}
        settings.update({"weights": stage.get("weights"), "chat": stage.get("chat", True),
                         "evaluate": stage.get("evaluate", True)})
        steps.append(Step(name, argv, "fit", settings))
    evaluation = config.get("evaluation") or {}
    if evaluation.get("enabled", True):
        steps.append(Step("evaluation", ["-m", "lit_minimind.report", "evaluate", "."], "evaluation",
                          {k: v for k, v in evaluation.items() if k != "enabled"}))
    steps.append(Step("report", ["-m", "lit_minimind.report", "card", "."], "report", {}))
    return steps


def settings_of(steps: list[Step]) -> list[list[Any]]:
    """What the record keeps of a plan to compare with a later start's: ``[name, {key: value}]`` per step."""
    return [[s.name, {"kind": s.kind, "argv": s.argv, **s.settings}] for s in steps]


def digest(steps: list[Step]) -> str:
    payload = json.dumps(settings_of(steps), sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def what_changed(old: list[list[Any]], new: list[list[Any]]) -> str | None:
    """The first difference between a recorded plan and this one, as ``step X, key: old -> new``; None if none."""
    old_names, new_names = [n for n, _ in old], [n for n, _ in new]
    if old_names != new_names:
        for i, (a, b) in enumerate(zip(old_names, new_names)):
            if a != b:
                return f"the steps: step {i + 1} was {a}, now {b}"
        if len(old_names) > len(new_names):
            return f"the steps: {', '.join(old_names[len(new_names):])} removed"
        return f"the steps: {', '.join(new_names[len(old_names):])} added"
    for (name, before), (_, after) in zip(old, new):
        keys = [k for k in [*before, *after] if k != "argv"]
        for key in dict.fromkeys(keys):
            if key not in before:
                return f"stage {name}, {key}: added ({_show(after[key])})"
            if key not in after:
                return f"stage {name}, {key}: removed (was {_show(before[key])})"
            if before[key] != after[key]:
                return f"stage {name}, {key}: {_show(before[key])} -> {_show(after[key])}"
        if before.get("argv") != after.get("argv"):
            return f"stage {name}: the order of its flags"
    return None


def _show(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


# ----------------------------------------------------------------------------------------------- the record


class Record:
    """``pipeline.json`` in the run directory: the plan, its digest, and per step its status and attempts."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / RECORD
        self.data: dict[str, Any] = {}

    def load(self) -> bool:
        try:
            self.data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return False
        except (OSError, ValueError) as err:
            raise ConfigError(f"{self.path}: unreadable ({err}); move it away to start this run directory afresh") from None
        return True

    def start(self, steps: list[Step], python: str, config_path: str) -> None:
        """A fresh record for ``steps``, or the recorded one if it is for the same plan (else ConfigError)."""
        plan_now = settings_of(steps)
        if self.load():
            changed = what_changed(self.data.get("plan", []), plan_now)
            if changed is not None:
                raise ConfigError(f"{self.path.parent} was started with another config ({self.data.get('config')}): "
                                  f"{changed}; rerun with that config, or give another --run_dir")
            return
        self.data = {"version": RECORD_VERSION, "config": config_path, "digest": digest(steps), "plan": plan_now,
                     "steps": {s.name: {"status": "pending", "command": s.command(python), "attempts": [], "wall_s": 0.0}
                               for s in steps}}
        self.save()

    def step(self, name: str) -> dict[str, Any]:
        return self.data["steps"][name]

    def save(self) -> None:
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# ----------------------------------------------------------------------------------------------- running


def die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the pipeline dies (Linux ``PR_SET_PDEATHSIG``), so a killed pipeline
    leaves no stage running that a rerun would race."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class Runner:
    """Runs the steps in order, passing stop signals to the running child."""

    def __init__(self, run_dir: Path, python: str, record: Record) -> None:
        self.run_dir, self.python, self.record = run_dir, python, record
        self.child: subprocess.Popen | None = None
        self.stop_signal: int | None = None

    def on_signal(self, signum: int, frame: object) -> None:
        first = self.stop_signal is None
        self.stop_signal = self.stop_signal or signum
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signum)  # the stage saves and stops (a second SIGINT: it aborts, as fit does)
        elif first:
            raise Stopped(signum)

    def install(self) -> None:
        for name in STOP_SIGNALS:
            signal.signal(getattr(signal, name), self.on_signal)

    def run(self, steps: list[Step]) -> int:
        for step in steps:
            entry = self.record.step(step.name)
            if entry["status"] == "done":
                print(f"pipeline: {step.name}: done already ({entry['wall_s']:.1f} s), skipped", flush=True)
                continue
            code = self.run_step(step, entry)
            if code != 0:
                return code
        print(f"pipeline: finished; report: {self.run_dir / 'report.md'} and {self.run_dir / 'report.html'}", flush=True)
        return 0

    def run_step(self, step: Step, entry: dict[str, Any]) -> int:
        if self.stop_signal is not None:
            raise Stopped(self.stop_signal)
        attempt = len(entry["attempts"]) + 1
        argv = [self.python, *self.argv_of(step)]
        print(f"pipeline: {step.name}: {'starting' if attempt == 1 else f'continuing (attempt {attempt})'}: "
              f"{shlex.join(argv)}", flush=True)
        entry["status"] = "running"
        entry["attempts"].append({"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "wall_s": None, "exit": None})
        self.record.save()
        (self.run_dir / "logs").mkdir(exist_ok=True)
        started = time.monotonic()
        with open(self.run_dir / "logs" / f"{step.name}.log", "a") as log:
            log.write(f"== attempt {attempt}: {shlex.join(argv)}\n")
            log.flush()
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            self.child = subprocess.Popen(argv, cwd=self.run_dir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True, start_new_session=True, preexec_fn=die_with_parent)
            output = []
            assert self.child.stdout is not None
            for line in self.child.stdout:
                output.append(line)
                log.write(line)
                log.flush()
                sys.stdout.write(line)
                sys.stdout.flush()
            code = self.child.wait()
            self.child = None
        text = "".join(output)
        wall = time.monotonic() - started
        last = entry["attempts"][-1]
        last.update({"wall_s": round(wall, 2), "exit": code})
        if where := RESUMED.search(text):
            last["resumed_at"] = (f"epoch {where[1]} step {where[2]}" if where[1] else f"epoch {where[3]} step 1")
        entry["wall_s"] = round(sum(a["wall_s"] or 0.0 for a in entry["attempts"]), 2)
        stopped = self.stop_signal is not None or (step.kind == "fit" and STOPPED.search(text))
        if code == 0 and not stopped:
            entry["status"] = "done"
            if logs := LOGS.findall(text):
                entry["logs"] = os.path.normpath(logs[-1])
            self.record.save()
            print(f"pipeline: {step.name}: done in {wall:.1f} s", flush=True)
            return 0
        self.record.save()
        if self.stop_signal is not None:
            raise Stopped(self.stop_signal)
        print(f"pipeline: {step.name} failed (exit {code}); the same command continues from here "
              f"(its output: {self.run_dir / 'logs' / (step.name + '.log')})", file=sys.stderr, flush=True)
        return code if code > 0 else 1

    def argv_of(self, step: Step) -> list[str]:
        if step.kind == "tokenizer" and "{embedded corpus}" in step.argv:
            from lit_minimind.data.corpus import write_embedded_corpus
            from lit_minimind.data.tokenizer import default_cache_dir

            corpus = str(write_embedded_corpus(default_cache_dir()))
            return [corpus if a == "{embedded corpus}" else a for a in step.argv]
        return step.argv


class Stopped(Exception):
    """A stop signal: the pipeline ends (the running stage has saved), exit 128 + the signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def lock(run_dir: Path) -> Any:
    """An exclusive lock on the run directory (held until the process ends): two pipelines never share one."""
    handle = open(run_dir / ".pipeline.lock", "w")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise ConfigError(f"{run_dir}: another pipeline is running in it") from None
    return handle


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lit_minimind.pipeline", description=description(__doc__))
    p.add_argument("--config", default=None, metavar="FILE",
                   help="the pipeline's YAML (default: the embedded corpus, conf/pipeline/default.yaml); a name in "
                   "conf/pipeline/ (minimind: MiniMind's own recipe, for a GPU) or a file")
    p.add_argument("--run_dir", default=DEFAULT_RUN_DIR, metavar="DIR",
                   help="where every stage runs and writes its files (default: %(default)s); the same command continues there")
    p.add_argument("--python", default=sys.executable, help="the Python each stage runs in (default: this one)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    run_dir = Path(args.run_dir)
    try:
        config = load_config(args.config)
        steps = plan(config)
        run_dir.mkdir(parents=True, exist_ok=True)
        held = lock(run_dir)
        record = Record(run_dir)
        record.start(steps, args.python, str(args.config or "pipeline"))
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    runner = Runner(run_dir, args.python, record)
    runner.install()
    print(f"pipeline: {run_dir} ({len(steps)} steps: {', '.join(s.name for s in steps)}; config {digest(steps)})", flush=True)
    try:
        return runner.run(steps)
    except Stopped as stop:
        name = signal.Signals(stop.signum).name
        print(f"pipeline: stopped by {name}; the same command continues where it was", file=sys.stderr, flush=True)
        return 128 + stop.signum
    finally:
        held.close()
