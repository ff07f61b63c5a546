"""``python -m lit_minimind.pipeline``: the whole pipeline as one resumable run, and its report card.

The fast tests check the config and the record without training: the plan's exact commands (the tokenizer step
when it is on), a changed config refused in one line naming the stage and the key, a finished run skipped step by
step, a bad config, and the report card built from a run directory's files (one self-contained HTML). The slow one
runs a tiny pipeline (3 optimizer steps per stage) uninterrupted, and again killed at random moments (SIGKILL inside a
stage, SIGTERM inside a stage, SIGKILL between stages, SIGKILL during the evaluation or the report): every stage's
exported weights (``out/*.pth``, byte for byte), metrics and evaluation equal the uninterrupted run's, and each rerun
continued at the step it was at (the stage, and inside it the batch after its last checkpoint).
"""

from __future__ import annotations

import csv
import json
import os
import random
import re
import signal
import sys
from pathlib import Path

import pytest
import yaml

from lit_minimind.cli.pipeline import DEFAULT_CONFIG, Record, load_config, plan
from tests.helpers.runs import LINE_RE, Run, expected_resume, resumed_at, run_cli

STEMS = {"pretrain": "pretrain_128", "sft": "full_sft_128", "dpo": "dpo_128", "reward": "reward_128",
         "grpo": "grpo_128", "ppo": "ppo_actor_128", "agent": "agent_128", "distill": "full_dist_64"}
TIMING = {"epoch_time", "tokens_per_s"}  # columns that measure the clock, not the training
STARTED = re.compile(r"^pipeline: (\S+): (?:starting|continuing \(attempt \d+\)):", re.M)
TINY_FIT = {"trainer.max_steps": 3, "log_interval": 1, "resume.save_interval": 1,
            "trainer.enable_progress_bar": False, "trainer.enable_model_summary": False}


def tiny_config(path: Path, **changes: object) -> Path:
    """The default pipeline with 3 optimizer steps per stage, saving at each, and two short samples per model."""
    config = yaml.safe_load(DEFAULT_CONFIG.read_text())
    config["fit_args"] = dict(TINY_FIT)
    for stage in config["stages"].values():
        stage["args"].pop("log_interval", None)  # every step on the console: the kills count its lines
        if "model.max_gen_len" in stage["args"]:  # the RL stages' rollouts short
            stage["args"]["model.max_gen_len"] = 16
    config["evaluation"].update(max_new_tokens=8, questions=config["evaluation"]["questions"][:2],
                                prompts=config["evaluation"]["prompts"][:1])
    for key, value in changes.items():
        stage, flag = key.split(":")
        config["stages"][stage]["args"][flag] = value
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def pipeline(cwd: Path, config: Path, run_dir: str = "run", **kwargs: object) -> Run:
    return run_cli(cwd, ["--config", str(config), "--run_dir", run_dir],
                   command=[sys.executable, "-m", "lit_minimind.pipeline"], **kwargs)


# -------------------------------------------------------------------------------------------------------- fast


def test_the_plan_is_each_stage_as_one_command_resuming_its_own_checkpoint() -> None:
    config = yaml.safe_load(DEFAULT_CONFIG.read_text())
    config["fit_args"] = {"trainer.max_steps": 2}
    steps = plan(config)
    assert [s.name for s in steps] == ["pretrain", "sft", "dpo", "reward", "grpo", "ppo", "agent", "distill", "evaluation",
                                       "report"]
    sft = steps[1].argv
    assert sft[:4] == ["-m", "lit_minimind.fit", "--trainer.max_steps", "2"]  # fit_args first, the stage's own after
    assert sft[-2:] == ["--ckpt_path", "last"] and sft.count("--ckpt_path") == 1
    assert " ".join(sft[4:-2]) == ("--data.kind sft --from_weight pretrain --data.max_seq_len 256 "
                                   "--data.empty_think_ratio 1 --trainer.max_epochs 30")
    assert "--model.teacher_use_moe false" in " ".join(steps[7].argv)  # YAML's false as the command line writes it
    assert steps[-2].argv == ["-m", "lit_minimind.report", "evaluate", "."]
    # MiniMind's tokenizer, when on: exactly the tokenizer command first, and every stage reads its directory
    config["tokenizer"] = {"enabled": True, "data": "corpus.jsonl", "vocab_size": 6400, "out_dir": "tokenizer"}
    steps = plan(config)
    assert steps[0].argv == ["-m", "lit_minimind.train_tokenizer", "corpus.jsonl", "--out_dir", "tokenizer",
                             "--vocab_size", "6400"]
    assert all("--data.tokenizer_path tokenizer" in " ".join(s.argv) for s in steps if s.kind == "fit")


def test_minimind_s_recipe_runs_each_stage_through_its_fit_preset() -> None:
    steps = {s.name: s.argv for s in plan(load_config("minimind")) if s.kind == "fit"}
    presets = {"pretrain": "minimind_pretrain", "sft": "minimind_sft", "dpo": "minimind_dpo", "reward": "minimind_dpo",
               "grpo": "minimind_grpo", "ppo": "minimind_ppo", "agent": "minimind_agent", "distill": "minimind_distill"}
    assert {name: argv[2:4] for name, argv in steps.items()} == {n: ["--config", p] for n, p in presets.items()}
    assert "--data.data_path dataset/rlaif.jsonl" in " ".join(steps["grpo"])  # MiniMind's files, relative to the run


def test_a_changed_config_is_refused_in_one_line_naming_the_stage_and_key(tmp_path: Path) -> None:
    first = tiny_config(tmp_path / "a.yaml")
    (tmp_path / "run").mkdir()
    Record(tmp_path / "run").start(plan(yaml.safe_load(first.read_text())), sys.executable, str(first))
    before = (tmp_path / "run" / "pipeline.json").read_bytes()
    changed = tiny_config(tmp_path / "b.yaml", **{"sft:trainer.max_epochs": 10})
    run = pipeline(tmp_path, changed, timeout=60)
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().count("\n") == 0, run.stderr  # one line
    assert "stage sft, --trainer.max_epochs: 30 -> 10" in run.stderr, run.stderr
    assert not (tmp_path / "run" / "out").exists() and (tmp_path / "run" / "pipeline.json").read_bytes() == before
    added = tiny_config(tmp_path / "c.yaml", **{"grpo:model.beta": 0.1})
    assert "stage grpo, --model.beta: added (0.1)" in pipeline(tmp_path, added, timeout=60).stderr


def test_a_finished_run_is_skipped_step_by_step(tmp_path: Path) -> None:
    config = tiny_config(tmp_path / "a.yaml")
    (tmp_path / "run").mkdir()
    record = Record(tmp_path / "run")
    record.start(plan(yaml.safe_load(config.read_text())), sys.executable, str(config))
    for entry in record.data["steps"].values():
        entry.update(status="done", wall_s=1.5)
    record.save()
    run = pipeline(tmp_path, config, timeout=60)
    assert run.returncode == 0, run.stderr
    assert len(re.findall(r"^pipeline: \S+: done already \(1.5 s\), skipped$", run.stdout, re.M)) == 10, run.stdout
    assert not STARTED.search(run.stdout) and not (tmp_path / "run" / "out").exists()


def test_a_bad_config_says_what_in_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("stages:\n  sft:\n    argz: {}\n")
    run = pipeline(tmp_path, bad, timeout=60)
    assert run.returncode == 2 and run.stderr.strip() == (
        f"error: {bad}: stage sft: unknown key 'argz' (known: args, chat, evaluate, weights)"), run.stderr
    missing = pipeline(tmp_path, tmp_path / "nope.yaml", timeout=60)
    assert missing.returncode == 2 and missing.stderr.startswith("error: --config ") and "No such file" in missing.stderr


def test_the_report_card_is_made_from_what_the_stages_logged(tmp_path: Path) -> None:
    """A run directory as a pipeline leaves it (record, metrics.csv, config.yaml, evaluation): report.md holds each
    stage's figures and samples, report.html is one file with its curves embedded."""
    from lit_minimind.report.card import write_card

    run = tmp_path / "run"
    config = yaml.safe_load(DEFAULT_CONFIG.read_text())
    config["stages"] = {"sft": config["stages"]["sft"]}
    record = Record(run)
    run.mkdir()
    record.start(plan(config), "python", "pipeline")
    record.data["steps"]["sft"].update(status="done", wall_s=12.5, logs="lightning_logs/version_0",
                                       attempts=[{"wall_s": 5.0, "exit": -9}, {"wall_s": 7.5, "exit": 0,
                                                                               "resumed_at": "epoch 1 step 3"}])
    record.save()
    logs = run / "lightning_logs" / "version_0"
    logs.mkdir(parents=True)
    with open(logs / "metrics.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["loss", "step", "epoch_time"])
        writer.writerows([[8.5 - s, s, 0.1] for s in range(1, 6)])
    (logs / "config.yaml").write_text("data: {batch_size: 16, max_seq_len: 256}\ntrainer: {devices: 1}\nmodel: {}\n")
    (run / "eval").mkdir()
    tasks = {"mm_arc": {"acc": 0.5, "acc_norm": 0.25}, "mm_cloze": {"acc": 0.75, "acc_norm": 0.5},
             "mm_gen": {"exact_match": 0.0}, "mm_ppl": {"bits_per_byte": 1.5, "byte_perplexity": 2.8,
                                                       "word_perplexity": 400.0}}
    (run / "eval" / "sft.json").write_text(json.dumps({"weights": "out/full_sft_128.pth", "tasks": tasks,
                                                       "samples": [{"prompt": "What is x?", "answer": "x is | y"}]}))
    assert write_card(run) == 0
    md = (run / "report.md").read_text()
    assert "| **sft** | done | 12.5 s (2 runs) | 5 | 80 samples (20,480 token positions of 256) | loss 3.5000 |" in md, md
    assert "| sft | 0.5000 | 0.2500 | 0.7500 | 0.5000 | 0.0000 | 1.5000 | 2.8000 |" in md
    assert "run 2 resumed at epoch 1 step 3" in md and "| What is x? | x is \\| y |" in md
    assert f"cd {run.resolve()} && python -m lit_minimind.fit " in md
    page = (run / "report.html").read_text()
    assert page.count('src="data:image/png;base64,') == 2  # the curve and the evaluation chart, inside the file
    assert not re.search(r'src="(?!data:)', page)  # nothing outside the file
    assert (run / "report" / "sft.png").read_bytes()[:4] == b"\x89PNG"


def test_the_card_counts_the_rl_stages_by_batch() -> None:
    """PPO steps its optimizers several times a batch: its prompts are counted by the logged micro-batches, not by
    optimizer steps; GRPO's and agent RL's rollouts are num_generations per prompt."""
    from lit_minimind.report.card import seen

    rows = [{"step": 4.0 * b, "micro_step": float(b)} for b in range(1, 20)]  # 19 batches, 4 updates each
    config = {"data": {"batch_size": 4}, "trainer": {"devices": 1}, "model": {"objective": "ppo"}}
    assert seen(rows, config) == (76, "76 prompts, 76 completions")
    config["model"] = {"objective": "agent", "num_generations": 4}
    assert seen(rows, config) == (76, "76 questions, 304 multi-turn rollouts")
    config["model"] = {"objective": "grpo", "num_generations": 3}
    assert seen(rows, config) == (76, "76 prompts, 228 completions")


# -------------------------------------------------------------------------------------------------------- slow


def stage_metrics(run_dir: Path) -> dict[str, list[dict[str, str]]]:
    """Each stage's metrics.csv rows (the log directory its summary named), the clock's columns left out."""
    record = json.loads((run_dir / "pipeline.json").read_text())
    out = {}
    for name in STEMS:
        with open(run_dir / record["steps"][name]["logs"] / "metrics.csv", newline="") as f:
            out[name] = [{k: v for k, v in row.items() if k not in TIMING} for row in csv.DictReader(f)]
    return out


def where_it_is(run_dir: Path) -> tuple[str, tuple[int, int] | None]:
    """The step a rerun must continue at (the first not done), and inside a fit stage the batch (1-based epoch,
    step) after its last checkpoint (None: it starts fresh)."""
    record = json.loads((run_dir / "pipeline.json").read_text())
    name = next(n for n, e in record["steps"].items() if e["status"] != "done")
    return name, expected_resume(run_dir, STEMS[name], iters=10**6) if name in STEMS else None


def killer(rng: random.Random, what: str, stages: list[str]) -> tuple[object, str]:
    """A per-line hook that stops the pipeline at a random moment of kind ``what``; and where, in words."""
    state = {"stage": None, "lines": 0}
    if what in ("inside", "sigterm"):
        # a SIGTERM may land on a stage's last step: its rerun has nothing left to train and keeps the epoch's row
        stage, after = rng.choice(stages), rng.randint(1, 2)
        where = f"{what} {stage} after its console line {after}"
    elif what == "between":
        stage, after = rng.choice(stages[:-1]), 0
        where = f"between {stage} and the next stage"
    else:
        stage, after = rng.choice(["evaluation", "report"]), 0
        where = f"during {stage}"

    def hook(line: str, running: object) -> bool:
        if started := STARTED.match(line):
            state.update(stage=started[1], lines=0)
        state["lines"] += bool(LINE_RE.search(line))
        if what == "between":
            return line.startswith(f"pipeline: {stage}: done in ")
        if what == "late":
            return state["stage"] == stage and (stage == "report" or line.startswith("evaluation: "))
        if state["stage"] == stage and state["lines"] >= after:
            if what == "sigterm":
                if not state.get("sent"):
                    state["sent"] = True
                    os.kill(running.proc.pid, signal.SIGTERM)
                return False
            return True
        return False

    return hook, where


@pytest.mark.slow
def test_killed_anywhere_the_pipeline_continues_and_equals_an_uninterrupted_one(tmp_path: Path) -> None:
    seed = int(os.environ.get("PIPELINE_KILL_SEED", random.randrange(10**6)))
    rng = random.Random(seed)
    config = tiny_config(tmp_path / "tiny.yaml")
    ref = pipeline(tmp_path, config, "ref", limit=900)
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    assert (tmp_path / "ref" / "report.md").is_file() and (tmp_path / "ref" / "report.html").is_file()

    run_dir, done, history = tmp_path / "run", [], []
    stages = list(STEMS)
    for what in ("inside", "sigterm", "between", "inside", "late"):
        remaining = [s for s in stages if s not in done] if (run_dir / "pipeline.json").is_file() else stages
        if what != "late" and len(remaining) < 2:
            continue
        hook, where = killer(rng, what, remaining)
        expected = where_it_is(run_dir) if (run_dir / "pipeline.json").is_file() else ("pretrain", None)
        run = pipeline(tmp_path, config, "run", on_line=hook, limit=900)
        history.append(where)
        context = f"seed {seed}, {' -> '.join(history)}\n{run.stdout[-3000:]}{run.stderr[-2000:]}"
        first = STARTED.search(run.stdout)
        assert first and first[1] == expected[0], context  # it continued at the step it was at
        if expected[0] in STEMS:
            section = run.stdout[first.start():].split("\npipeline: ", 1)[0]
            assert resumed_at(section) == expected[1], context  # ... and inside it, at the batch after its checkpoint
        if what == "sigterm":
            assert run.returncode == 128 + signal.SIGTERM, context
            assert "stopped by SIGTERM" in run.stdout and "pipeline: stopped by SIGTERM" in run.stderr, context
        else:
            assert run.returncode in (-signal.SIGKILL, 0), context
        if run.returncode == 0:
            break
        record = json.loads((run_dir / "pipeline.json").read_text())
        done = [n for n, e in record["steps"].items() if e["status"] == "done"]
    if run.returncode != 0:
        expected = where_it_is(run_dir)
        run = pipeline(tmp_path, config, "run", limit=900)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        assert STARTED.search(run.stdout)[1] == expected[0]
    record = json.loads((run_dir / "pipeline.json").read_text())
    assert any(len(record["steps"][s]["attempts"]) > 1 for s in STEMS), f"seed {seed}: no stage was interrupted"

    for name in sorted(p.name for p in (tmp_path / "ref" / "out").glob("*.pth")):
        assert (run_dir / "out" / name).read_bytes() == (tmp_path / "ref" / "out" / name).read_bytes(), (seed, name)
    assert stage_metrics(run_dir) == stage_metrics(tmp_path / "ref"), seed
    for name in sorted(p.name for p in (tmp_path / "ref" / "eval").glob("*.json")):
        assert json.loads((run_dir / "eval" / name).read_text()) == json.loads((tmp_path / "ref" / "eval" / name).read_text())
    assert (run_dir / "report.md").is_file() and (run_dir / "report.html").is_file()
    print(f"seed {seed}: {' -> '.join(history)}; attempts per step: "
          f"{ {n: len(e['attempts']) for n, e in record['steps'].items()} }")
