"""MiniMind's agent RL as a stage of ``python -m lit_minimind.fit`` (``--model.objective agent``, ``train_agent.py``):
MiniMind's argv reproduces its own run step for step (tests/fixtures/agent, made by make_minimind_agent.py: CPU fp32,
the memorized 64x2 model as policy and reference, a zero reward model), resumes from MiniMind's resume file as
MiniMind does, and resumes exactly after SIGKILLs anywhere and a SIGTERM mid-rollout; a demo on the embedded questions."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers.rollouts import assert_minimind_loads_rl_resume, assert_sigterm_mid_rollout_resumes_exactly, rollout_rows
from tests.helpers.runs import (
    QUIET,
    TOKENIZER,
    assert_resumed,
    assert_same_files,
    assert_steps_match,
    cli_env,
    expected_resume,
    need_shared,
    run_cli,
    run_until_done,
)

FIXTURE = Path(__file__).parent / "fixtures" / "agent"
RUNS = json.loads((FIXTURE / "runs.json").read_text(encoding="utf-8"))
MEMORIZED = Path(__file__).parent / "fixtures" / "serve" / "memorized_64.pth"
ROLLOUTS = "--trainer.callbacks+=tests.helpers.rollouts.RolloutLog"
FILES = ["out/agent_64.pth", "checkpoints/agent_64_resume.pth"]
TOL = 2e-4
# rollouts.jsonl's names of MiniMind's console values (runs.json's)
VALUES = {"loss": "loss", "reward": "reward", "kl_ref": "kl", "group_reward_std": "grp_std", "advantages_std": "adv_std",
          "advantages_mean": "adv_mean", "avg_response_len": "avg_len", "lr": "lr"}


def minimind_argv(run: str, *extra: str) -> list[str]:
    """runs.json's argv of MiniMind's train_agent.py (as it is: its flags set the stage), ``--save_dir out``, the
    shared tokenizer and the rollout log; ``extra`` first (a preset)."""
    argv = [a.replace("<fixture>", str(FIXTURE)) for a in RUNS[run]["argv"]]
    return [*extra, *argv, "--save_dir", "out", "--data.tokenizer_path", str(TOKENIZER), ROLLOUTS, *QUIET]


def start_from_memorized(run_dir: Path) -> None:
    (run_dir / "out").mkdir(parents=True, exist_ok=True)
    shutil.copy(MEMORIZED, run_dir / "out" / "memorized_64.pth")


def minimind_lines(run: str) -> dict[tuple[int, int], str]:
    """MiniMind's printed console lines of the fixture run, by (1-based epoch, step)."""
    lines = [line for line in (FIXTURE / f"{run}_log.txt").read_text(encoding="utf-8").splitlines()
             if line.startswith("Epoch:[")]
    return {(int(line[7:].split("/")[0]), int(line.split("](")[1].split("/")[0])): line for line in lines}


def assert_minimind_steps(run_dir: Path, stdout: str, run: str) -> None:
    """Every step MiniMind trained the port trained too: the same packed trajectories (so the same sampled tokens,
    tool calls and tool results), rewards, and console values within 2e-4; the printed lines are MiniMind's."""
    expected = RUNS[run]["steps"]
    got = {(r["epoch"], r["step"]): r for r in map(json.loads, (run_dir / "rollouts.jsonl").read_text().splitlines())}
    assert sorted(got) == [(s["epoch"], s["step"]) for s in expected]
    for s in expected:
        where, row = (s["epoch"], s["step"]), got[(s["epoch"], s["step"])]
        assert row["completion_ids"] == s["input_ids"], f"step {where}: other trajectories"
        assert max(abs(a - b) for a, b in zip(row["rewards"], s["rewards"])) < 1e-5, where
        for ours, theirs in VALUES.items():
            assert abs(row[ours] - s[theirs]) <= TOL, (where, ours, row[ours], s[theirs])
    printed = [line for line in stdout.splitlines() if line.startswith("Epoch:[")]
    assert printed == list(minimind_lines(run).values())


@pytest.mark.slow  # 8 steps, ~15 s alone, more beside other tests; the resumed run below is in make test
def test_minimind_agent_argv_reproduces_its_run(tmp_path: Path) -> None:
    need_shared()
    start_from_memorized(tmp_path)
    out = run_cli(tmp_path, minimind_argv("full", "--config", "minimind_agent"))  # MiniMind's defaults, then its argv
    assert out.returncode == 0, out.stderr[-3000:]
    assert "--num_generations 2 -> --model.objective agent --model.num_generations 2" in out.stdout  # its --max_total_len
    assert_minimind_steps(tmp_path, out.stdout, "full")
    export = torch.load(tmp_path / "out" / "agent_64.pth", weights_only=True)
    resume = torch.load(tmp_path / "checkpoints" / "agent_64_resume.pth", weights_only=True)
    assert set(export) == set(resume["model"]) and all(v.dtype == torch.float16 for v in export.values())
    assert resume["start_weights"]["path"] == "out/memorized_64.pth"  # the reference: re-read and checked on resume


def test_from_resume_continues_minimind_agent_file(tmp_path: Path) -> None:
    """MiniMind's resume file after epoch 1 step 2 (fp16 weights, no RNG state): the port continues as MiniMind does,
    torch's stream and Python's random seeded at the epoch's start, and rolls out MiniMind's resumed run."""
    need_shared()
    start_from_memorized(tmp_path)
    (tmp_path / "checkpoints").mkdir()
    shutil.copy(FIXTURE / "checkpoints__agent_64_resume.e0s2.pth", tmp_path / "checkpoints" / "agent_64_resume.pth")
    out = run_cli(tmp_path, minimind_argv("resumed"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert_resumed(out, 1, 3)
    assert_minimind_steps(tmp_path, out.stdout, "resumed")
    assert_minimind_loads_rl_resume(tmp_path / "checkpoints" / "agent_64_resume.pth", FIXTURE / "checkpoints__agent_64_resume.e0s2.pth")


def test_agent_demo_on_the_embedded_questions(tmp_path: Path) -> None:
    """No data path: the embedded demo questions for the six tools; two steps write MiniMind's files; the stage's
    defaults (data kind, thinking ratio 0.1, --model.max_total_len 2500) are set."""
    need_shared()
    start_from_memorized(tmp_path)
    out = run_cli(tmp_path, ["--model.objective", "agent", "--from_weight", "memorized", "--data.tokenizer_path",
                             str(TOKENIZER), "--model.hidden_size", "64", "--model.num_hidden_layers", "2",
                             "--model.max_gen_len", "8", "--model.num_generations", "2", "--data.batch_size", "2",
                             "--trainer.max_steps", "2", "--trainer.accelerator", "cpu", "--log_interval", "1", ROLLOUTS,
                             *QUIET])
    assert out.returncode == 0, out.stderr[-3000:]
    assert "agent RL: files named agent (MiniMind's train_agent.py" in out.stdout
    assert sorted(out.steps) == [(1, 1), (1, 2)]
    assert {line[3] for line in out.lines} == {"12"}  # an epoch: 24 questions, batch 2
    rows = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    assert all(len(r["rewards"]) == 4 for r in rows)
    assert all(r["completion_ids"] for r in rows)
    throughput = next(line for line in out.stdout.splitlines() if line.startswith("throughput: "))
    assert float(throughput.split()[1].replace(",", "")) > 0, throughput  # the packed trajectories' tokens
    assert (tmp_path / "out" / "agent_64.pth").is_file()
    saved = torch.load(tmp_path / "checkpoints" / "agent_64_resume.pth", weights_only=False)
    assert saved["start_weights"]["path"] == "out/memorized_64.pth"
    data = saved["datamodule_hyper_parameters"]  # set with the stage: its data kind, train_agent.py's thinking ratio
    assert (data["kind"], data["thinking_ratio"], data["data_path"]) == ("agent", 0.1, None)
    assert saved["hyper_parameters"]["max_total_len"] == 2500


def test_train_agent_flags_set_the_stage() -> None:
    """train_agent.py's own flag (--max_total_len) or its preset make the GRPO flags it shares mean agent RL."""
    from lit_minimind.cli.flags import translate

    assert translate(["--num_generations", "2", "--max_total_len", "9"]).args == [
        "--model.objective", "agent", "--model.num_generations", "2", "--model.max_total_len", "9"]
    assert translate(["--config", "minimind_agent", "--thinking_ratio", "0.5"]).args == [
        "--config", "minimind_agent", "--model.objective", "agent", "--data.thinking_ratio", "0.5"]
    assert translate(["--num_generations", "2"]).args[:2] == ["--model.objective", "grpo"]


def test_agent_data_and_objective_must_agree(tmp_path: Path) -> None:
    """Agent records for another stage, or another stage's data for agent RL: one line, exit 2."""
    need_shared()
    start_from_memorized(tmp_path)
    out = run_cli(tmp_path, ["--model.objective", "grpo", "--data.kind", "agent", "--from_weight", "memorized",
                             "--data.tokenizer_path", str(TOKENIZER), "--model.hidden_size", "64",
                             "--model.num_hidden_layers", "2", "--trainer.max_steps", "1", *QUIET])
    assert out.returncode == 2
    assert "--data.kind agent holds tool-use questions for --model.objective agent, not for grpo" in out.stderr


def tiny_agent_args(*extra: str) -> list[str]:
    """The fixture's 8 questions (tool turns and --max_total_len cuts among them), 2 epochs x 4 steps, accumulation 2,
    thinking in half the rollouts."""
    return ["--model.objective", "agent", "--from_weight", str(MEMORIZED), "--data.data_path",
            str(FIXTURE / "agent_prompts.jsonl"), "--data.tokenizer_path", str(TOKENIZER), "--model.hidden_size", "64",
            "--model.num_hidden_layers", "2", "--data.batch_size", "2", "--model.num_generations", "2",
            "--model.max_gen_len", "24", "--model.max_total_len", "320", "--model.learning_rate", "1e-3",
            "--data.thinking_ratio", "0.5", "--trainer.accumulate_grad_batches", "2", "--trainer.max_epochs", "2",
            "--trainer.accelerator", "cpu", "--trainer.devices", "1", "--log_interval", "1",
            "--resume.save_interval", "2", *QUIET, *extra]


@pytest.mark.slow  # several runs: make test-slow
def test_kill_anywhere_agent(tmp_path: Path) -> None:
    """SIGKILLed after random console lines (mid-rollout, mid-tool-call included) and inside saves, resumed with
    --ckpt_path last: every step's trajectories, rewards and values and the final files are the uninterrupted
    run's, bit for bit; each rerun resumed where its checkpoint said (run_until_done asserts it)."""
    need_shared()
    ref_dir, kill_dir = tmp_path / "ref", tmp_path / "killed"
    ref_dir.mkdir(), kill_dir.mkdir()
    ref = run_cli(ref_dir, tiny_agent_args(ROLLOUTS))
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert len(ref.steps) == 8
    runs = run_until_done(kill_dir, tiny_agent_args(ROLLOUTS), random.Random("kill-agent"), kills=3, total_lines=8,
                          stem="agent_64", iters=4)
    assert len(runs) >= 2, "no kill happened"
    assert_steps_match(runs, ref)
    assert rollout_rows(kill_dir) == rollout_rows(ref_dir)  # every trajectory, reward and value, bit for bit
    assert_same_files(ref_dir, kill_dir, FILES)


@pytest.mark.slow  # three runs: make test-slow
def test_sigterm_mid_rollout_saves_at_the_step_and_resumes_exactly(tmp_path: Path) -> None:
    """SIGTERM while a step rolls out: the step finishes, is saved, the run exits 0; the resumed run starts at the
    next step and ends with the uninterrupted run's files and values."""
    need_shared()
    last = assert_sigterm_mid_rollout_resumes_exactly(tmp_path, tiny_agent_args(), FILES, line=3, iters=4)
    assert (1, 3) <= last < (2, 4)


@pytest.mark.slow  # 2-process runs: make test-slow
def test_agent_ddp_killed_and_resumed_exactly(tmp_path: Path) -> None:
    """DDP 2 processes: each rank rolls out its own questions from its own streams (torch's and Python's); the group
    SIGKILLed inside a save and resumed ends with the uninterrupted run's files and prints the same values after it."""
    need_shared()
    ddp = tiny_agent_args("--trainer.devices", "2", "--trainer.strategy", "ddp", "--resume.save_interval", "1")
    ref_dir, killed_dir = tmp_path / "ref", tmp_path / "killed"
    ref_dir.mkdir(), killed_dir.mkdir()
    ref = run_cli(ref_dir, ddp)
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert sorted(ref.steps) == [(1, 1), (1, 2), (2, 1), (2, 2)]  # 8 questions: 4 per rank, batch 2
    ranks = torch.load(ref_dir / "checkpoints" / "agent_64_resume.pth", weights_only=True)["lit_minimind"]["ranks"]
    assert not torch.equal(*[state["rng"]["torch"] for state in ranks]), "both ranks drew the same numbers"
    assert ranks[0]["rng"]["python"] != ranks[1]["rng"]["python"], "both ranks drew the same thinking"
    killed = run_cli(killed_dir, ddp, env=cli_env(LIT_MINIMIND_TEST_STOP_IN_SAVE="2:checkpoint"))
    assert killed.returncode == -9
    want = expected_resume(killed_dir, "agent_64", iters=2)  # after the save before the one killed
    assert want is not None and want > (1, 1), want
    resumed = run_cli(killed_dir, ddp + ["--ckpt_path", "last"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_resumed(resumed, *want)
    assert resumed.steps == {k: v for k, v in ref.steps.items() if k >= want}
    assert_same_files(ref_dir, killed_dir, FILES)


@pytest.mark.slow  # two runs: make test-slow
def test_reward_model_scores_the_answers_and_is_checked_on_resume(tmp_path: Path) -> None:
    """--model.reward_model: the same first step's trajectories as with rule rewards alone, other rewards (its score of
    the answers without tool calls); a resume without it is refused in one line."""
    need_shared()
    from tests.test_grpo import make_reward_model

    scorer_file = tmp_path / "reward_64.pth"
    make_reward_model(scorer_file, 0)
    rows = {}
    for name, extra in (("rules", []), ("scored", ["--model.reward_model", str(scorer_file)])):
        (tmp_path / name).mkdir()
        run = run_cli(tmp_path / name, tiny_agent_args(ROLLOUTS, "--trainer.max_steps", "1", *extra))
        assert run.returncode == 0, run.stderr[-3000:]
        rows[name] = json.loads((tmp_path / name / "rollouts.jsonl").read_text().splitlines()[0])
    assert rows["rules"]["completion_ids"] == rows["scored"]["completion_ids"]
    assert rows["rules"]["rewards"] != rows["scored"]["rewards"], "the reward model added nothing"
    again = run_cli(tmp_path / "scored", [*tiny_agent_args("--trainer.max_steps", "2"), "--ckpt_path", "last"])
    assert again.returncode == 2
    assert f"--model.reward_model none, but the checkpoint was trained with {scorer_file}" in again.stderr
