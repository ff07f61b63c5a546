"""Agent RL against MiniMind's own train_agent.py run (tests/fixtures/agent/runs.json, made by
make_minimind_agent.py beside it): a plain loop over lit_minimind.model.agent's rollout, reward, packing and loss
samples MiniMind's tokens turn for turn (tool calls run, tool results appended) and matches every step's
console values, uninterrupted and resumed from MiniMind's own resume file."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch

from lit_minimind.checkpoint.read import read_checkpoint
from lit_minimind.checkpoint.weights import model_weights
from lit_minimind.data.agent import AgentDataset, collate_agent
from lit_minimind.data.tokenizer import PAD_ID, load_tokenizer
from lit_minimind.model import MiniMindConfig, MiniMindForCausalLM
from lit_minimind.model.agent import agent_loss, pack, rollout_batch, token_log_probs, trajectory_rewards
from lit_minimind.model.grpo import group_advantages, seed_rollout_stream

HERE = Path(__file__).parent / "fixtures" / "agent"
MEMORIZED = Path(__file__).parent / "fixtures" / "serve" / "memorized_64.pth"
TOKENIZER = Path(__file__).resolve().parents[2] / "shared" / "minimind" / "tokenizer"
RUNS = json.loads((HERE / "runs.json").read_text(encoding="utf-8"))
TOL = 2e-4

pytestmark = pytest.mark.skipif(not TOKENIZER.is_dir(), reason="needs ../shared/minimind/tokenizer")


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def model_from(state: dict) -> MiniMindForCausalLM:
    model = MiniMindForCausalLM(MiniMindConfig(hidden_size=64, num_hidden_layers=2))
    model.load_state_dict(state)  # MiniMind: its fp16 file into an fp32 model
    return model


def run_port(run: dict, tmp_path: Path, resume: dict | None = None) -> list[dict]:
    """train_agent.py's loop (CPU fp32, no accumulation) with the port's functions; one row per step."""
    argv = run["argv"]
    batch_size, generations = int(flag(argv, "--batch_size")), int(flag(argv, "--num_generations"))
    max_gen, max_total = int(flag(argv, "--max_gen_len")), int(flag(argv, "--max_total_len"))
    thinking, lr, epochs = float(flag(argv, "--thinking_ratio")), float(flag(argv, "--learning_rate")), int(flag(argv, "--epochs"))
    tokenizer = load_tokenizer(TOKENIZER)
    data = AgentDataset(HERE / "agent_prompts.jsonl", cache_dir=tmp_path)
    torch.manual_seed(42)
    weights = model_weights(read_checkpoint(MEMORIZED))
    policy, reference = model_from(weights), model_from(weights).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=lr)
    iters = math.ceil(len(data) / batch_size)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=iters * epochs, eta_min=lr / 10)
    start_step = 0
    if resume is not None:
        policy.load_state_dict(resume["model"])
        optimizer.load_state_dict(resume["optimizer"])
        scheduler.load_state_dict(resume["scheduler"])
        start_step = resume["step"]
    rows = []
    for epoch in range(resume["epoch"] if resume else 0, epochs):
        seed_rollout_stream(epoch, len(data), torch.device("cpu"))  # setup_seed(42 + epoch), randperm, loader seed
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(42 + epoch)).tolist()
        rng = random.Random(42 + epoch)  # setup_seed's Python random: the thinking draws
        skip = start_step if epoch == (resume or {}).get("epoch") else 0
        for step in range(skip + 1, iters + 1):
            batch = collate_agent([data[i] for i in order[(step - 1) * batch_size: step * batch_size]])
            trajectories = rollout_batch(policy, tokenizer, batch, generations, max_gen, thinking, rng)
            rewards = trajectory_rewards(trajectories, batch, generations)
            input_ids, loss_mask, old_logps = pack(trajectories, max_total)
            attention = (input_ids != PAD_ID).long()
            out = policy(input_ids, attention_mask=attention)
            logps = token_log_probs(out.logits, input_ids)
            with torch.no_grad():
                ref_logps = token_log_probs(reference(input_ids, attention_mask=attention).logits, input_ids)
            advantages = group_advantages(rewards, generations)
            loss, kl = agent_loss(logps, ref_logps, old_logps, advantages, loss_mask, "cispo", 0.1, 0.2, 5.0)
            loss = loss + out.aux_loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            rows.append({"epoch": epoch, "step": step, "turn_outputs": [t.turn_outputs for t in trajectories],
                         "unfinished": [t.unfinished for t in trajectories], "input_ids": input_ids.tolist(),
                         "loss_tokens": loss_mask.sum(dim=1).tolist(), "rewards": rewards.tolist(),
                         "loss": loss.item(), "reward": rewards.mean().item(), "kl": kl.item(),
                         "grp_std": rewards.view(-1, generations).std(dim=1, unbiased=False).mean().item(),
                         "adv_std": advantages.std().item(), "adv_mean": advantages.mean().item(),
                         "avg_len": loss_mask.sum(dim=1).mean().item(), "lr": optimizer.param_groups[0]["lr"]})
    return rows


def check_rows(rows: list[dict], expected: list[dict]) -> None:
    assert [(r["epoch"], r["step"]) for r in rows] == [(e["epoch"], e["step"]) for e in expected]
    for got, want in zip(rows, expected):
        where = (want["epoch"], want["step"])
        for key in ("turn_outputs", "unfinished", "input_ids", "loss_tokens", "rewards"):
            assert got[key] == want[key], (where, key)
        for key in ("loss", "reward", "kl", "grp_std", "adv_std", "adv_mean", "avg_len", "lr"):
            assert abs(got[key] - want[key]) <= TOL, (where, key, got[key], want[key])


def test_fixture_exercises_tool_turns():
    steps = RUNS["full"]["steps"]
    assert any(len(turns) > 1 for s in steps for turns in s["turn_outputs"])  # tool results appended, resumed
    assert any("<tool_call>" in t for s in steps for turns in s["turn_outputs"] for t in turns)
    assert any(len(ids) == 320 for s in steps for ids in s["input_ids"])  # --max_total_len cut some
    assert len({r for s in steps for r in s["rewards"]}) > 5


# the CLI reproduces the same run (tests/test_agent_stage.py, in CI); this loop over the functions alone is the
# matrix's (make test-matrix): where a difference lies when that test fails
@pytest.mark.matrix
def test_port_is_minimind_s_run(tmp_path):
    check_rows(run_port(RUNS["full"], tmp_path), RUNS["full"]["steps"])


@pytest.mark.matrix
def test_port_resumes_from_minimind_s_file_as_minimind(tmp_path):
    resume = torch.load(HERE / "checkpoints__agent_64_resume.e0s2.pth", map_location="cpu", weights_only=False)
    check_rows(run_port(RUNS["resumed"], tmp_path, resume), RUNS["resumed"]["steps"])
