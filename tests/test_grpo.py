"""MiniMind's GRPO / CISPO stage (``trainer/train_grpo.py``): its rewards and losses, its runs token for token,
its resume files; a reward model as the scorer; exact resume after kills.

Fixture: ``tests/fixtures/grpo`` (made by its ``make_minimind_grpo.py`` from MiniMind d65ef2c: the dense 64x2
SFT export as policy and reference, CPU fp32, rule rewards only: MiniMind's reward model replaced by a zero
scorer, the port's ``--model.reward_model none``): CISPO with thinking always open, clipped GRPO with it always
closed, GRPO with MiniMind's random choice (``mixed``; ``workers``: drawn in 2 DataLoader workers), and CISPO on a model that thinks and stops (``think``:
tests/fixtures/serve's memorized model), each uninterrupted and resumed from MiniMind's own resume file.
"""

from __future__ import annotations

import json
import math
import random
import re
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers.rollouts import assert_minimind_loads_rl_resume, assert_sigterm_mid_rollout_resumes_exactly, rollout_rows
from tests.helpers.runs import (
    MINIMIND,
    QUIET,
    SFT_EXPORT,
    SHARED,
    TOKENIZER,
    assert_resumed,
    assert_same_files,
    assert_steps_match,
    cli_env,
    need_shared,
    run_cli,
    run_until_done,
)

FIXTURE = Path(__file__).parent / "fixtures" / "grpo"
RUNS = json.loads((FIXTURE / "runs.json").read_text()) if (FIXTURE / "runs.json").exists() else {}
SFT_JSONL = MINIMIND / "sft" / "sft.jsonl"
ROLLOUTS = "--trainer.callbacks+=tests.helpers.rollouts.RolloutLog"
MEMORIZED = Path(__file__).parent / "fixtures" / "serve" / "memorized_64.pth"


# ----------------------------------------------------------------------------- MiniMind's code, as it is written


def minimind_rep_penalty(text: str, n: int = 3, cap: float = 0.5) -> float:
    toks = re.findall(r"\w+|[^\w\s]", text.lower())
    grams = [tuple(toks[i:i + n]) for i in range(len(toks) - n + 1)]
    return min(cap, (len(grams) - len(set(grams))) * cap * 2 / len(grams)) if grams else 0.0


def minimind_rule_reward(response: str) -> float:
    """calculate_rewards of train_grpo.py for one response, the reward model's score 0."""
    reward = torch.zeros(1)
    reward[0] += 0.5 if 20 <= len(response.strip()) <= 800 else -0.5
    answer = response
    if "</think>" in response:
        thinking_content, answer_content = response.split("</think>", 1)
        reward[0] += 1.0 if 20 <= len(thinking_content.strip()) <= 300 else -0.5
        reward[0] += 0.25 if response.count("</think>") == 1 else -0.25
        answer = answer_content.strip()
    reward[0] -= minimind_rep_penalty(answer)
    return float(reward[0])


def minimind_policy_loss(per_token_logps: torch.Tensor, old: torch.Tensor, ref: torch.Tensor, rewards: torch.Tensor,
                         completion_ids: torch.Tensor, generations: int, loss_type: str, beta: float = 0.1,
                         epsilon: float = 0.2, epsilon_high: float = 5.0) -> torch.Tensor:
    """grpo_train_epoch's advantages, completion mask and loss, as MiniMind writes them."""
    grouped_rewards = rewards.view(-1, generations)
    mean_r = grouped_rewards.mean(dim=1).repeat_interleave(generations)
    std_r = grouped_rewards.std(dim=1, unbiased=False).repeat_interleave(generations)
    advantages = (rewards - mean_r) / (std_r + 1e-4)
    completion_pad_mask = torch.ones_like(completion_ids).bool()
    is_eos = (completion_ids == 2) & completion_pad_mask
    eos_idx = torch.full((is_eos.size(0),), is_eos.size(1) - 1, dtype=torch.long)
    eos_idx[is_eos.any(dim=1)] = is_eos.int().argmax(dim=1)[is_eos.any(dim=1)]
    completion_mask = ((torch.arange(is_eos.size(1)).expand(is_eos.size(0), -1) <= eos_idx.unsqueeze(1))
                       & completion_pad_mask).int()
    kl_div = ref - per_token_logps
    per_token_kl = torch.exp(kl_div) - kl_div - 1
    ratio = torch.exp(per_token_logps - old)
    if loss_type == "cispo":
        clamped_ratio = torch.clamp(ratio, max=epsilon_high).detach()
        per_token_loss = -(clamped_ratio * advantages.unsqueeze(1) * per_token_logps - beta * per_token_kl)
    else:
        clipped_ratio = torch.clamp(ratio, 1 - epsilon, 1 + epsilon)
        per_token_loss = -(torch.min(ratio * advantages.unsqueeze(1), clipped_ratio * advantages.unsqueeze(1))
                           - beta * per_token_kl)
    return ((per_token_loss * completion_mask).sum(dim=1) / completion_mask.sum(dim=1).clamp(min=1)).mean()


# ----------------------------------------------------------------------------- pure functions


@pytest.mark.parametrize("response", [
    "short", "x" * 30, " " * 5 + "y" * 25 + " " * 5, "a b c a b c a b c a b c and more words here",
    "I think about it carefully enough here</think>The answer is four.",
    "tiny</think>The answer is four, clearly.", "one</think>two</think>three words of an answer",
    "z" * 900, "think " * 80 + "</think>" + "the same words again and again " * 4,
])
def test_rule_rewards_are_miniminds(response: str) -> None:
    from lit_minimind.model.grpo import rule_rewards

    reward, answer = rule_rewards(response)
    assert abs(reward - minimind_rule_reward(response)) < 1e-6, (reward, minimind_rule_reward(response))
    assert answer == (response.split("</think>", 1)[1].strip() if "</think>" in response else response)


@pytest.mark.parametrize("loss_type", ["cispo", "grpo"])
def test_policy_loss_is_miniminds(loss_type: str) -> None:
    """The port's loss and gradient equal MiniMind's with the old log-probs of the sampling policy (the one trained:
    equal to the new ones), on completions with and without EOS; advantages and mask as MiniMind computes them."""
    from lit_minimind.model.grpo import completion_mask, group_advantages, policy_loss

    gen = torch.Generator().manual_seed(3)
    groups, generations, length = 2, 4, 7
    logps = (-torch.rand(groups * generations, length, generator=gen) * 3).requires_grad_(True)
    ref = -torch.rand(groups * generations, length, generator=gen) * 3
    rewards = torch.randn(groups * generations, generator=gen)
    completion_ids = torch.randint(3, 50, (groups * generations, length), generator=gen)
    completion_ids[0, 2] = completion_ids[0, 5] = 2  # EOS twice: up to the first
    completion_ids[3, 6] = 2
    completion_ids[5, 0] = 2
    want = minimind_policy_loss(logps, logps.detach(), ref, rewards, completion_ids, generations, loss_type)
    got, kl = policy_loss(logps, ref, group_advantages(rewards, generations), completion_mask(completion_ids),
                          loss_type, 0.1, 0.2, 5.0)
    assert torch.allclose(got, want, atol=1e-6), (got, want)
    grad, = torch.autograd.grad(got, logps)
    want_grad, = torch.autograd.grad(want, logps)
    assert torch.allclose(grad, want_grad, atol=1e-7)
    assert grad[0, 3:].abs().sum() == 0 and grad[0, :3].abs().sum() > 0  # nothing after the first EOS
    mask = completion_mask(completion_ids)
    assert mask.sum(dim=1).tolist()[:6] == [3, 7, 7, 7, 7, 1]
    assert abs(float(kl) - float(((ref - logps.detach()) * mask).sum() / mask.sum())) < 1e-6


def test_rlaif_prompts_are_miniminds_chat_template() -> None:
    """A prompt is the conversation without its answer slot, rendered with the generation prompt; the thinking
    block opens with probability thinking_ratio (never at 0, always at 1); the batch is left-padded."""
    need_shared()
    from lit_minimind.data.chat_template import load_chat_template
    from lit_minimind.data.rlaif import RLAIFDataset, collate_prompts
    from lit_minimind.data.tokenizer import load_tokenizer

    tok = load_tokenizer(TOKENIZER)
    template = load_chat_template(TOKENIZER)
    first = json.loads(SFT_JSONL.read_text().splitlines()[0])["conversations"]
    for ratio in (0.0, 1.0):
        data = RLAIFDataset(SFT_JSONL, tok, max_length=96, chat_template=template, add_system_ratio=0.0,
                            thinking_ratio=ratio)
        text, ids = data[0]
        assert text.endswith("<|im_start|>assistant\n" + ("<think>\n" if ratio else "<think>\n\n</think>\n\n"))
        assert first[-2]["content"].strip()[:20] in text and first[-1]["content"][:20] not in text
        assert len(ids) <= 96 and ids[-1] == tok.encode(text, add_special_tokens=False).ids[-1]
    batch = collate_prompts([data[0], data[1]])
    width = batch["input_ids"].shape[1]
    for row, (text, ids) in enumerate([data[0], data[1]]):
        assert batch["input_ids"][row, width - len(ids):].tolist() == ids
        assert batch["attention_mask"][row].tolist() == [0] * (width - len(ids)) + [1] * len(ids)
    if RUNS:  # MiniMind's own prompt strings (thinking on in the CISPO runs, off in the GRPO runs)
        for run, ratio in (("cispo_full", 1.0), ("grpo_full", 0.0)):
            data = RLAIFDataset(SFT_JSONL, tok, max_length=96, chat_template=template, add_system_ratio=0.0,
                                thinking_ratio=ratio)
            order = torch.randperm(len(data), generator=torch.Generator().manual_seed(42)).tolist()
            assert [data.prompt(i) for i in order[:2]] == RUNS[run]["steps"][0]["prompts"]


# ----------------------------------------------------------------------------- MiniMind's runs


def minimind_argv(run: str) -> list[str]:
    """runs.json's argv of MiniMind's script with the shared data, ``--save_dir out``, the shared tokenizer, the
    augmentation pinned as in the fixture, and the rollout log."""
    argv = [a.replace("<shared>", str(SHARED)).replace("<fixture>", str(FIXTURE)) for a in RUNS[run]["argv"][2:]]
    return ["--config", "minimind_grpo", *argv, "--save_dir", "out", "--data.tokenizer_path", str(TOKENIZER),
            "--data.add_system_ratio", "0", ROLLOUTS, *QUIET]


def start_from_sft(run_dir: Path) -> None:
    """MiniMind's --from_weight full_sft, and the fixture's think runs' --from_weight memorized (a model that
    answers its prompt with a thinking block and EOS: tests/fixtures/serve)."""
    (run_dir / "out").mkdir(parents=True, exist_ok=True)
    shutil.copy(SFT_EXPORT, run_dir / "out" / "full_sft_64.pth")
    shutil.copy(MEMORIZED, run_dir / "out" / "memorized_64.pth")


def assert_minimind_steps(run_dir: Path, expected: list[dict]) -> None:
    """Every step MiniMind trained, the port trained too: the same sampled tokens, rewards, loss, KL and lr."""
    got = {(r["epoch"], r["step"]): r for r in map(json.loads, (run_dir / "rollouts.jsonl").read_text().splitlines())}
    assert sorted(got) == [(s["epoch"], s["step"]) for s in expected]
    for s in expected:
        where, r = (s["epoch"], s["step"]), got[(s["epoch"], s["step"])]
        assert r["completion_ids"] == s["completion_ids"], f"step {where}: other tokens sampled"
        assert max(abs(a - b) for a, b in zip(r["rewards"], s["rewards"])) < 1e-5, where
        assert abs(r["loss"] - (s["policy_loss"])) <= 2e-4, (where, r["loss"], s["policy_loss"])
        assert abs(r["kl_ref"] - s["kl_ref"]) <= 2e-4 and abs(r["reward"] - s["reward"]) <= 2e-4, where
        assert abs(r["lr"] - s["lr"]) <= 1e-9 * max(1.0, s["lr"]) + 1e-12, (where, r["lr"], s["lr"])


SLOW = pytest.mark.slow  # make test keeps two resumed runs: MiniMind's draws restarted, a thinking model that stops
MATRIX = pytest.mark.matrix  # the same resume of MiniMind's file under another loss or thinking ratio: make test-matrix


@pytest.mark.parametrize("run", [pytest.param(r, marks=SLOW) for r in ("cispo_full", "grpo_full", "mixed_full",
                                                                         "think_full", "workers_full")])
def test_minimind_grpo_argv_reproduces_its_run(tmp_path: Path, run: str) -> None:
    need_shared()
    if run not in RUNS:
        pytest.skip(f"tests/fixtures/grpo/runs.json has no {run}")
    start_from_sft(tmp_path)
    out = run_cli(tmp_path, minimind_argv(run))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "--model.objective grpo" in out.stdout  # the first of train_grpo.py's flags sets the objective
    assert_minimind_steps(tmp_path, RUNS[run]["steps"])
    export = torch.load(tmp_path / "out" / "grpo_64.pth", weights_only=True)
    resume = torch.load(tmp_path / "checkpoints" / "grpo_64_resume.pth", weights_only=True)
    assert set(export) == set(resume["model"]) and all(v.dtype == torch.float16 for v in export.values())
    start = RUNS[run]["argv"][RUNS[run]["argv"].index("--from_weight") + 1]
    assert resume["start_weights"]["path"] == f"out/{start}_64.pth"  # the reference: re-read and checked on resume


@pytest.mark.parametrize("run", ["think_resumed", pytest.param("cispo_resumed", marks=SLOW),
                                 pytest.param("workers_resumed", marks=SLOW), pytest.param("mixed_resumed", marks=MATRIX),
                                 pytest.param("grpo_resumed", marks=MATRIX)])
def test_from_resume_continues_minimind_grpo_file(tmp_path: Path, run: str) -> None:
    """MiniMind's resume file (fp16 weights, no RNG state): the port continues as MiniMind does, its stream
    seeded at the epoch's start, and samples MiniMind's resumed run's tokens."""
    need_shared()
    if run not in RUNS:
        pytest.skip(f"tests/fixtures/grpo/runs.json has no {run}")
    start_from_sft(tmp_path)
    (tmp_path / "checkpoints").mkdir()
    kind = run.split("_")[0]
    saved = next(FIXTURE.glob(f"checkpoints__grpo_64_resume.{kind}.e0s*.pth"))
    shutil.copy(saved, tmp_path / "checkpoints" / "grpo_64_resume.pth")
    out = run_cli(tmp_path, minimind_argv(run))
    assert out.returncode == 0, out.stderr[-3000:]
    assert_resumed(out, 1, int(saved.name.split(".e0s")[1].split(".")[0]) + 1)
    assert_minimind_steps(tmp_path, RUNS[run]["steps"])
    assert_minimind_loads_rl_resume(tmp_path / "checkpoints" / "grpo_64_resume.pth", saved)


# ----------------------------------------------------------------------------- exact resume, the reward model


def tiny_grpo_args(*extra: str) -> list[str]:
    return ["--model.objective", "grpo", "--from_weight", str(SFT_EXPORT), "--data.data_path", str(SFT_JSONL),
            "--data.tokenizer_path", str(TOKENIZER), "--model.hidden_size", "64", "--model.num_hidden_layers", "2",
            "--data.max_seq_len", "64", "--data.batch_size", "4", "--model.num_generations", "3",
            "--model.max_gen_len", "12", "--model.learning_rate", "1e-3", "--data.thinking_ratio", "0.5",
            "--trainer.accumulate_grad_batches", "2", "--trainer.max_epochs", "1", "--trainer.accelerator", "cpu",
            "--trainer.devices", "1", "--log_interval", "1", "--resume.save_interval", "4", *QUIET, *extra]


@pytest.mark.slow  # make test-slow: keeps make test under its budget
def test_kill_anywhere_grpo(tmp_path: Path) -> None:
    """SIGKILLed after random console lines (mid-rollout included) and inside saves, resumed with --ckpt_path
    last: every step's rewards, KL and losses, the sampled tokens and the final files are the uninterrupted
    run's, bit for bit."""
    need_shared()
    ref_dir, kill_dir = tmp_path / "ref", tmp_path / "killed"
    ref_dir.mkdir()
    kill_dir.mkdir()
    ref = run_cli(ref_dir, tiny_grpo_args(ROLLOUTS))
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert len(ref.steps) == 12
    runs = run_until_done(kill_dir, tiny_grpo_args(ROLLOUTS), random.Random("kill-grpo"), kills=3, total_lines=12,
                          stem="grpo_64")
    assert len(runs) >= 2, "no kill happened"
    assert_steps_match(runs, ref)
    assert rollout_rows(kill_dir, "completion_ids") == rollout_rows(ref_dir, "completion_ids")
    assert_same_files(ref_dir, kill_dir, ["out/grpo_64.pth", "checkpoints/grpo_64_resume.pth"])


@pytest.mark.slow  # three runs: make test-slow
def test_sigterm_mid_rollout_saves_at_the_step_and_resumes_exactly(tmp_path: Path) -> None:
    """SIGTERM while a step samples: the step finishes, is saved, the run exits 0; the resumed run starts at the next
    step and ends with the uninterrupted run's files."""
    need_shared()
    last = assert_sigterm_mid_rollout_resumes_exactly(tmp_path, tiny_grpo_args(), ["out/grpo_64.pth",
                                                      "checkpoints/grpo_64_resume.pth"], line=3, iters=12)
    assert last < (1, 12)


def make_reward_model(path: Path, seed: int) -> None:
    from lit_minimind.model import MiniMindConfig
    from lit_minimind.model.reward import RewardModel

    torch.manual_seed(seed)
    model = RewardModel(MiniMindConfig(hidden_size=64, num_hidden_layers=2))
    torch.nn.init.normal_(model.value_head.weight, std=2.0)
    torch.save({k: v.half() for k, v in model.state_dict().items()}, path)


@pytest.mark.slow  # make test's budget: 14.6 min on a clean clone, 2026-12-03 (make test-slow)
def test_reward_model_scores_and_is_checked_on_resume(tmp_path: Path) -> None:
    """With --model.reward_model, each reward is the rule terms plus the model's clipped score of the answer (as
    MiniMind's LMForRewardModel folds the history); a resume with another reward model file is refused (one without
    the reward model it was trained with too: reward_model_mismatches)."""
    need_shared()
    from lit_minimind.data.chat_template import load_chat_template
    from lit_minimind.data.tokenizer import load_tokenizer
    from lit_minimind.model.grpo import RewardScorer, rule_rewards

    scorer_file = tmp_path / "reward_64.pth"
    make_reward_model(scorer_file, 0)
    scorer = RewardScorer(scorer_file, load_tokenizer(TOKENIZER), load_chat_template(TOKENIZER))
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    scores = [scorer.get_score(messages, answer) for answer in ("Four.", "It is 4, of course.", "fish " * 40)]
    assert len(set(scores)) == 3 and all(-3.0 <= s <= 3.0 for s in scores)
    args = tiny_grpo_args(ROLLOUTS, "--model.reward_model", str(scorer_file), "--trainer.max_steps", "1")
    first = run_cli(tmp_path, args)
    assert first.returncode == 0, first.stderr[-3000:]
    row = json.loads((tmp_path / "rollouts.jsonl").read_text().splitlines()[0])
    rules = [rule_rewards(t)[0] for t in load_tokenizer(TOKENIZER).decode_batch(row["completion_ids"],
                                                                                 skip_special_tokens=True)]
    assert any(abs(r - rule) > 1e-3 for r, rule in zip(row["rewards"], rules)), "the reward model added nothing"
    make_reward_model(scorer_file, 1)
    again = run_cli(tmp_path, [*args[:-2], "--trainer.max_steps", "4", "--ckpt_path", "last"])
    assert again.returncode == 2
    assert f"--model.reward_model {scorer_file} changed since the checkpoint was written" in again.stderr


@pytest.mark.slow  # make test-slow (budget)
def test_a_resume_without_the_reward_model_it_was_trained_with_is_refused(tmp_path: Path) -> None:
    need_shared()
    scorer_file = tmp_path / "reward_64.pth"
    make_reward_model(scorer_file, 0)
    first = run_cli(tmp_path, tiny_grpo_args("--model.reward_model", str(scorer_file), "--trainer.max_steps", "1"))
    assert first.returncode == 0, first.stderr[-3000:]
    none = run_cli(tmp_path, [*tiny_grpo_args("--trainer.max_steps", "2"), "--ckpt_path", "last"])
    assert none.returncode == 2
    assert f"--model.reward_model none, but the checkpoint was trained with {scorer_file}" in none.stderr


@pytest.mark.slow  # the fixture runs check the lr of MiniMind's own runs in make test
def test_grpo_lr_is_miniminds_cosine(tmp_path: Path) -> None:
    """CosineAnnealingLR over ceil(iters / accumulation) * epochs optimizer steps, down to a tenth."""
    need_shared()
    run = run_cli(tmp_path, tiny_grpo_args("--trainer.max_epochs", "2", "--model.max_gen_len", "2"))
    assert run.returncode == 0, run.stderr[-3000:]
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=math.ceil(12 / 2) * 2, eta_min=1e-4)
    want = {}
    for epoch in range(2):
        for step in range(1, 13):
            if step % 2 == 0:
                opt.step()
                sched.step()
            want[(epoch + 1, step)] = opt.param_groups[0]["lr"]
    got = {k: float(v[-1]) for k, v in run.steps.items()}
    assert got.keys() == want.keys()
    assert all(abs(got[k] - want[k]) < 1e-8 for k in want), [(k, got[k], want[k]) for k in want]


@pytest.mark.slow  # 2-process runs: about a minute (make test-slow)
def test_grpo_ddp_killed_and_resumed_exactly(tmp_path: Path) -> None:
    """DDP 2 processes: each rank samples its own prompts from its own stream; the group SIGKILLed inside a save
    and resumed ends with the uninterrupted run's files, and the steps after the resume print the same values."""
    need_shared()
    from lit_minimind.model.grpo import RANK_SEED_STRIDE

    ddp = tiny_grpo_args("--trainer.devices", "2", "--trainer.strategy", "ddp", "--trainer.max_epochs", "2")
    ref_dir, killed_dir = tmp_path / "ref", tmp_path / "killed"
    ref_dir.mkdir(), killed_dir.mkdir()
    ref = run_cli(ref_dir, ddp)
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert len(ref.steps) == 12  # 2 epochs x 6 batches per rank
    ranks = torch.load(ref_dir / "checkpoints" / "grpo_64_resume.pth", weights_only=True)["lit_minimind"]["ranks"]
    streams = [state["rng"]["torch"] for state in ranks]
    assert not torch.equal(*streams), "both ranks drew the same numbers"
    assert RANK_SEED_STRIDE > 2  # rank 1 never reuses the seed of a later epoch of rank 0
    killed = run_cli(killed_dir, ddp, env=cli_env(LIT_MINIMIND_TEST_STOP_IN_SAVE="2:checkpoint"))
    assert killed.returncode == -9
    resumed = run_cli(killed_dir, ddp + ["--ckpt_path", "last"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_resumed(resumed, 1, 5)
    assert resumed.steps == {k: v for k, v in ref.steps.items() if k >= (1, 5)}
    assert_same_files(ref_dir, killed_dir, ["out/grpo_64.pth", "checkpoints/grpo_64_resume.pth"])
