"""MiniMind's PPO stage (``trainer/train_ppo.py``): GAE and its losses, its runs token for token, its resume files
both ways, exact resume after kills.

Fixture: ``tests/fixtures/ppo`` (made by its ``make_minimind_ppo.py`` from MiniMind d65ef2c: CPU fp32, actor, critic
backbone and reference from the same 64x2 file, rule rewards only: MiniMind's reward model replaced by a zero
scorer, the port's ``--model.reward_model none``): ``ppo`` (the shared SFT model, 2 passes in minibatches of 1) and
``think`` (tests/fixtures/serve's memorized model, whose samples end with EOS; 3 passes, accumulation 3, passes
stopped early on KL), each uninterrupted and resumed from MiniMind's own resume file.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from tests.helpers.rollouts import assert_sigterm_mid_rollout_resumes_exactly, rollout_rows
from tests.helpers.runs import (
    QUIET,
    SFT_EXPORT,
    SHARED,
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

FIXTURE = Path(__file__).parent / "fixtures" / "ppo"
RUNS = json.loads((FIXTURE / "runs.json").read_text()) if (FIXTURE / "runs.json").exists() else {}
ROLLOUTS = "--trainer.callbacks+=tests.helpers.rollouts.RolloutLog"
MEMORIZED = Path(__file__).parent / "fixtures" / "serve" / "memorized_64.pth"
SLOW = pytest.mark.slow


# ----------------------------------------------------------------------------- MiniMind's code, as it is written


def minimind_update(old_resp_logp, ref_resp_logp, mb_resp_logp, old_resp_values, mb_resp_values, rewards,
                    resp_lengths, mask, gamma=1.0, lam=0.95, clip_epsilon=0.2, cliprange_value=0.2, kl_coef=0.02):
    """ppo_train_epoch's GAE, whitening and one minibatch's losses (all rows), as MiniMind writes them."""
    B = old_resp_logp.shape[0]
    token_rewards = torch.zeros_like(old_resp_logp)
    last_idx = resp_lengths - 1
    token_rewards[torch.arange(B), last_idx] += rewards
    gen_len = old_resp_values.size(1); lastgaelam = torch.zeros(B); advs_rev = []  # noqa: E702
    for t in reversed(range(gen_len)):
        nv = old_resp_values[:, t + 1] if t < gen_len - 1 else 0.0
        delta = token_rewards[:, t] + gamma * nv - old_resp_values[:, t]
        lastgaelam = delta + gamma * lam * lastgaelam
        advs_rev.append(lastgaelam)
    advantages = torch.stack(advs_rev[::-1], dim=1)
    returns = advantages + old_resp_values
    adv_mean = (advantages * mask).sum() / mask.sum().clamp(min=1)
    adv_var = ((advantages - adv_mean) ** 2 * mask).sum() / mask.sum().clamp(min=1)
    advantages = (advantages - adv_mean) * torch.rsqrt(adv_var + 1e-8) * mask
    log_ratio = mb_resp_logp - old_resp_logp
    approx_kl = (0.5 * (log_ratio ** 2) * mask).sum() / mask.sum().clamp(min=1)
    ratio = torch.exp(log_ratio)
    clipfrac = (((ratio - 1.0).abs() > clip_epsilon).float() * mask).sum() / mask.sum().clamp(min=1)
    kl_ref_penalty = ((torch.exp(ref_resp_logp - mb_resp_logp) - (ref_resp_logp - mb_resp_logp) - 1.0)
                      * mask).sum() / mask.sum().clamp(min=1)
    policy_loss = ((torch.max(-advantages * ratio, -advantages * torch.clamp(ratio, 1.0 - clip_epsilon, 1.0 + clip_epsilon))
                    * mask).sum() / mask.sum().clamp(min=1) + kl_coef * kl_ref_penalty)
    value_loss = 0.5 * (torch.max((mb_resp_values - returns) ** 2,
                                  (torch.clamp(mb_resp_values, old_resp_values - cliprange_value,
                                               old_resp_values + cliprange_value) - returns) ** 2)
                        * mask).sum() / mask.sum().clamp(min=1)
    return {"policy_loss": policy_loss, "value_loss": value_loss, "approx_kl": approx_kl, "clipfrac": clipfrac,
            "kl_ref": kl_ref_penalty}


# ----------------------------------------------------------------------------- pure functions


def test_gae_and_losses_are_miniminds() -> None:
    """GAE, whitening and the clipped losses (values and gradients) equal MiniMind's, EOS rows included."""
    from lit_minimind.model.grpo import completion_mask
    from lit_minimind.model.ppo import gae, ppo_losses, whiten

    gen = torch.Generator().manual_seed(5)
    rows, length = 4, 9
    completion_ids = torch.randint(3, 50, (rows, length), generator=gen)
    completion_ids[0, 3] = completion_ids[0, 6] = 2  # EOS twice: the reward at the first
    completion_ids[2, 0] = 2
    mask = completion_mask(completion_ids).float()
    lengths = mask.sum(dim=1).long()
    old = -torch.rand(rows, length, generator=gen) * 3
    ref = -torch.rand(rows, length, generator=gen) * 3
    new = (old + torch.randn(rows, length, generator=gen) * 0.3).requires_grad_(True)
    old_values = torch.randn(rows, length, generator=gen) * mask
    values = (old_values + torch.randn(rows, length, generator=gen) * 0.4).requires_grad_(True)
    rewards = torch.randn(rows, generator=gen)
    want = minimind_update(old, ref, new, old_values, values, rewards, lengths, mask)
    token_rewards = torch.zeros_like(old)
    token_rewards[torch.arange(rows), lengths - 1] += rewards
    advantages, returns = gae(token_rewards, old_values, 1.0, 0.95)
    got = ppo_losses(new, old, ref, values, old_values, whiten(advantages, mask), returns, mask, 0.2, 0.2, 0.02)
    for key, value in want.items():
        assert torch.allclose(got[key], value, atol=1e-6), (key, got[key], value)
    assert 0 < float(got["clipfrac"]) < 1, "the clip is exercised"
    grads = torch.autograd.grad(got["policy_loss"] + 0.5 * got["value_loss"], [new, values])
    want_grads = torch.autograd.grad(want["policy_loss"] + 0.5 * want["value_loss"], [new, values])
    for g, w in zip(grads, want_grads):
        assert torch.allclose(g, w, atol=1e-7)
    assert grads[0][0, 4:].abs().sum() == 0 and grads[0][0, :4].abs().sum() > 0  # nothing after the first EOS


def test_critic_head_is_miniminds_draw() -> None:
    """MiniMind's value head after setup_seed(42) and three models built (actor, reference, critic): recorded
    from MiniMind d65ef2c's model_minimind.py (64x2)."""
    from lit_minimind.model import MiniMindConfig
    from lit_minimind.model.ppo import critic_head_init

    head = critic_head_init(MiniMindConfig(hidden_size=64, num_hidden_layers=2), 42)
    assert torch.allclose(head["weight"][0, :4], torch.tensor([0.0907, 0.0337, -0.0517, 0.0191]), atol=1e-4)
    assert torch.allclose(head["bias"], torch.tensor([0.0749]), atol=1e-4)


# ----------------------------------------------------------------------------- MiniMind's runs


def minimind_argv(run: str) -> list[str]:
    """runs.json's argv of MiniMind's script with the shared data, ``--save_dir out``, the shared tokenizer, no
    random system prompt (as the fixture's patch), and the rollout log."""
    argv = [a.replace("<shared>", str(SHARED)).replace("<fixture>", str(FIXTURE)) for a in RUNS[run]["argv"][2:]]
    return ["--config", "minimind_ppo", *argv, "--save_dir", "out", "--data.tokenizer_path", str(TOKENIZER),
            "--data.add_system_ratio", "0", ROLLOUTS, *QUIET]


def start_weights(run_dir: Path) -> None:
    (run_dir / "out").mkdir(parents=True, exist_ok=True)
    shutil.copy(SFT_EXPORT, run_dir / "out" / "full_sft_64.pth")
    shutil.copy(MEMORIZED, run_dir / "out" / "memorized_64.pth")


def assert_minimind_steps(run_dir: Path, expected: list[dict]) -> None:
    """Every step MiniMind trained, the port trained too: the same sampled tokens, rewards and console values."""
    got = {(r["epoch"], r["step"]): r for r in map(json.loads, (run_dir / "rollouts.jsonl").read_text().splitlines())}
    assert sorted(got) == [(s["epoch"], s["step"]) for s in expected]
    for s in expected:
        where, r = (s["epoch"], s["step"]), got[(s["epoch"], s["step"])]
        assert r["completion_ids"] == s["completion_ids"], f"step {where}: other tokens sampled"
        assert max(abs(a - b) for a, b in zip(r["rewards"], s["rewards"])) < 1e-5, where
        for mine, theirs in (("reward", "reward"), ("kl_ref", "kl_ref"), ("approx_kl", "approx_kl"),
                             ("clipfrac", "clipfrac"), ("critic_loss", "critic_loss"), ("loss", "actor_loss"),
                             ("avg_response_len", "avg_response_len")):
            assert abs(r[mine] - s[theirs]) <= 2e-4, (where, mine, r[mine], s[theirs])
        for mine, theirs in (("lr", "actor_lr"), ("critic_lr", "critic_lr")):
            assert abs(r[mine] - s[theirs]) <= 1e-9 * s[theirs] + 1e-12, (where, mine, r[mine], s[theirs])


def assert_within_fp16_ulp(path: Path, want_path: Path) -> None:
    got, want = torch.load(path, weights_only=True), torch.load(want_path, weights_only=True)
    assert set(got) == set(want) and all(v.dtype == torch.float16 for v in got.values())
    for key, w in want.items():
        ulp = (torch.nextafter(w.float().abs().half(), torch.tensor(float("inf"), dtype=torch.float16)).float()
               - w.float().abs())
        assert ((got[key].float() - w.float()).abs() <= ulp).all(), key


@pytest.mark.parametrize("run", ["think_full", pytest.param("ppo_full", marks=SLOW)])
def test_minimind_ppo_argv_reproduces_its_run(tmp_path: Path, run: str) -> None:
    need_shared()
    start_weights(tmp_path)
    out = run_cli(tmp_path, minimind_argv(run))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "--model.objective ppo" in out.stdout  # the first of train_ppo.py's flags sets the objective
    assert "PPO: a prompt over --data.max_seq_len keeps its first tokens" in out.stdout  # its tokenizer call's rule
    assert_minimind_steps(tmp_path, RUNS[run]["steps"])
    assert_within_fp16_ulp(tmp_path / "out" / "ppo_actor_64.pth", FIXTURE / f"{run}_export.pth")
    log_lines = [line for line in (FIXTURE / f"{run}_log.txt").read_text().splitlines() if line.startswith("Epoch:[")]
    assert log_lines[-1] in out.stdout  # MiniMind's console line, character for character
    resume = torch.load(tmp_path / "checkpoints" / "ppo_actor_64_resume.pth", weights_only=False)
    theirs = torch.load(next(FIXTURE.glob(f"checkpoints__ppo_actor_64_resume.{run.split('_')[0]}.e0s*.pth")),
                        weights_only=False)
    for key in ("model", "optimizer", "scheduler", "critic_model", "critic_optimizer", "critic_scheduler"):
        assert key in resume, key
    assert set(resume["critic_model"]) == set(theirs["critic_model"])
    assert resume["scheduler"]["T_max"] == theirs["scheduler"]["T_max"]
    assert_minimind_loads(tmp_path / "checkpoints" / "ppo_actor_64_resume.pth", run)


@pytest.mark.parametrize("run", ["think_resumed", pytest.param("ppo_resumed", marks=SLOW)])
def test_from_resume_continues_minimind_ppo_file(tmp_path: Path, run: str) -> None:
    """MiniMind's PPO resume file (fp16 actor, fp32 critic, both optimizers and schedulers, no RNG): the port
    continues as MiniMind does and ends with MiniMind's resumed export."""
    need_shared()
    start_weights(tmp_path)
    (tmp_path / "checkpoints").mkdir()
    kind = run.split("_")[0]
    saved = next(FIXTURE.glob(f"checkpoints__ppo_actor_64_resume.{kind}.e0s*.pth"))
    shutil.copy(saved, tmp_path / "checkpoints" / "ppo_actor_64_resume.pth")
    out = run_cli(tmp_path, minimind_argv(run))
    assert out.returncode == 0, out.stderr[-3000:]
    assert_resumed(out, 1, int(saved.name.split(".e0s")[1].split(".")[0]) + 1)
    assert_minimind_steps(tmp_path, RUNS[run]["steps"])
    assert_within_fp16_ulp(tmp_path / "out" / "ppo_actor_64.pth", FIXTURE / f"{run}_export.pth")


def minimind_updates(steps: list[dict], accumulation: int) -> int:
    """Optimizer steps MiniMind took: every ``accumulation`` minibatches (a counter per epoch) and at a rollout's end."""
    updates, count, epoch = 0, 0, None
    for s in steps:
        if s["epoch"] != epoch:
            count, epoch = 0, s["epoch"]
        for _ in range(s["minibatches"]):
            count += 1
            updates += count % accumulation == 0
        updates += count % accumulation != 0
    return updates


def assert_minimind_loads(path: Path, run: str) -> None:
    """What train_ppo.py's ``--from_resume 1`` does with the port's file: every ``load_state_dict`` succeeds strictly
    (actor, critic, both AdamW, both CosineAnnealingLR), at MiniMind's update count and next LR, and the schedulers
    step on to MiniMind's following LR."""
    from lit_minimind.model import MiniMindConfig, MiniMindForCausalLM
    from lit_minimind.model.ppo import CriticModel
    from lit_minimind.model.schedules import annealed_lr

    argv = RUNS[run]["argv"]
    flag = lambda name: float(argv[argv.index(name) + 1])  # noqa: E731
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    config = MiniMindConfig(hidden_size=64, num_hidden_layers=2)
    actor, critic = MiniMindForCausalLM(config), CriticModel(config)
    actor.load_state_dict(ckpt["model"])
    critic.load_state_dict(ckpt["critic_model"])
    total = ckpt["scheduler"]["T_max"]
    for model, opt_key, sched_key, peak in ((actor, "optimizer", "scheduler", flag("--learning_rate")),
                                            (critic, "critic_optimizer", "critic_scheduler", flag("--critic_learning_rate"))):
        opt = torch.optim.AdamW(model.parameters(), lr=peak)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total, eta_min=peak / 10)
        opt.load_state_dict(ckpt[opt_key])
        sched.load_state_dict(ckpt[sched_key])
        steps = ckpt[sched_key]["last_epoch"]
        assert steps == minimind_updates(RUNS[run]["steps"], int(flag("--accumulation_steps")))
        assert abs(opt.param_groups[0]["lr"] - annealed_lr(steps, total, peak)) < 1e-12
        opt.step()
        sched.step()
        assert abs(opt.param_groups[0]["lr"] - annealed_lr(steps + 1, total, peak)) < 1e-10


# ----------------------------------------------------------------------------- exact resume


def tiny_ppo_args(*extra: str) -> list[str]:
    return ["--model.objective", "ppo", "--from_weight", str(MEMORIZED), "--data.data_path",
            str(Path(__file__).parent / "fixtures" / "grpo" / "think_prompts.jsonl"), "--data.tokenizer_path",
            str(TOKENIZER), "--model.hidden_size", "64", "--model.num_hidden_layers", "2", "--data.max_seq_len", "64",
            "--data.batch_size", "2", "--model.mini_batch_size", "1", "--model.max_gen_len", "16",
            "--model.learning_rate", "5e-4", "--model.critic_learning_rate", "2e-4", "--model.ppo_update_iters", "3",
            "--model.early_stop_kl", "0.002", "--data.thinking_ratio", "0.5", "--trainer.accumulate_grad_batches", "2",
            "--trainer.max_epochs", "3", "--trainer.accelerator", "cpu", "--trainer.devices", "1", "--log_interval", "1",
            "--resume.save_interval", "3", *QUIET, *extra]


@SLOW
def test_kill_anywhere_ppo(tmp_path: Path) -> None:
    """SIGKILLed after random console lines (mid-rollout, between update passes) and inside saves, resumed with
    --ckpt_path last: every step's values, the sampled tokens and the final files are the uninterrupted run's."""
    need_shared()
    ref_dir, kill_dir = tmp_path / "ref", tmp_path / "killed"
    ref_dir.mkdir(), kill_dir.mkdir()
    ref = run_cli(ref_dir, tiny_ppo_args(ROLLOUTS))
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert len(ref.steps) == 12
    runs = run_until_done(kill_dir, tiny_ppo_args(ROLLOUTS), random.Random("kill-ppo"), kills=3, total_lines=12,
                          stem="ppo_actor_64", iters=4)
    assert len(runs) >= 2, "no kill happened"
    assert_steps_match(runs, ref)
    assert rollout_rows(kill_dir) == rollout_rows(ref_dir)  # every float of every step, bit for bit
    assert_same_files(ref_dir, kill_dir, ["out/ppo_actor_64.pth", "checkpoints/ppo_actor_64_resume.pth"])


@SLOW
def test_sigterm_mid_rollout_saves_and_resumes_exactly(tmp_path: Path) -> None:
    """SIGTERM while a step samples: the step finishes, is saved, the run exits 0; the resumed run starts at the next
    step (the epoch's accumulation counter and update count restored) and ends with the uninterrupted run's files."""
    need_shared()
    last = assert_sigterm_mid_rollout_resumes_exactly(tmp_path, tiny_ppo_args(), ["out/ppo_actor_64.pth",
                                                      "checkpoints/ppo_actor_64_resume.pth"], line=2, iters=4)
    assert last < (3, 4)


def test_ppo_refuses_a_grad_scaler(tmp_path: Path) -> None:
    """fp16 with a GradScaler: MiniMind's PPO has none, and the critic's step would see scaled gradients."""
    need_shared()
    out = run_cli(tmp_path, tiny_ppo_args("--trainer.plugins", "lit_minimind.model.precision.CPUFloat16Mixed",
                                          "--trainer.max_steps", "1"))
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    assert "PPO with --trainer.precision 16-mixed is not supported" in out.stderr


def test_train_ppo_flags_set_the_ppo_objective() -> None:
    """train_ppo.py's own flags mean PPO (also beside the flags it shares with train_grpo.py), and so does its preset."""
    from lit_minimind.cli.flags import translate

    assert translate(["--max_gen_len", "24", "--kl_coef", "0.1"]).args == \
        ["--model.objective", "ppo", "--model.max_gen_len", "24", "--model.beta", "0.1"]
    assert translate(["--config", "minimind_ppo", "--thinking_ratio", "0.5"]).args[:4] == \
        ["--config", "minimind_ppo", "--model.objective", "ppo"]
    assert translate(["--max_gen_len", "24"]).args[:2] == ["--model.objective", "grpo"]
    args = translate(["--clip_epsilon", "0.1", "--critic_learning_rate", "1e-6", "--ppo_update_iters", "3",
                      "--mini_batch_size", "4", "--early_stop_kl", "0.5", "--gamma", "0.99", "--lam", "0.9",
                      "--vf_coef", "0.25", "--cliprange_value", "0.3"]).args
    assert args[:2] == ["--model.objective", "ppo"] and "--model.epsilon" in args and "--model.vf_coef" in args


class RankWeights(pl.Callback):
    """Test callback (``--trainer.callbacks+=tests.test_ppo.RankWeights``): at the end of training rank 0 prints every
    rank's actor and critic weights as two sums each (``@@rank-weights ...``): equal only if the gradients of both
    models were all-reduced at every step."""

    def on_train_end(self, trainer: pl.Trainer, module: Any) -> None:
        flat = torch.cat([p.detach().double().flatten() for p in (*module.model.parameters(), *module.critic.parameters())])
        mark = torch.stack([flat.sum(), (flat * torch.arange(flat.numel(), dtype=torch.float64)).sum()])
        every = trainer.strategy.all_gather(mark)
        if trainer.global_rank == 0:
            print("@@rank-weights", " ".join(f"{v:.17g}" for v in every.flatten().tolist()), flush=True)


@SLOW
def test_ppo_ddp_killed_and_resumed_exactly(tmp_path: Path) -> None:
    """DDP, 2 processes (gloo): each rank samples its own prompts from its own stream, the gradients of actor and
    critic are all-reduced (both ranks end with the same weights) and the early KL stop is agreed by the ranks; the
    group SIGKILLed inside a save and resumed ends with the uninterrupted run's files and printed steps."""
    need_shared()
    ddp = tiny_ppo_args("--trainer.devices", "2", "--trainer.strategy", "ddp", "--resume.save_interval", "1",
                        "--trainer.callbacks+=tests.test_ppo.RankWeights")
    ref_dir, killed_dir = tmp_path / "ref", tmp_path / "killed"
    ref_dir.mkdir(), killed_dir.mkdir()
    ref = run_cli(ref_dir, ddp)
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert len(ref.steps) == 6  # 3 epochs x 2 batches per rank
    marks = [float(v) for v in ref.stdout.split("@@rank-weights ")[1].splitlines()[0].split()]
    assert marks[:2] == marks[2:], f"the ranks' weights differ: {marks}"
    ranks = torch.load(ref_dir / "checkpoints" / "ppo_actor_64_resume.pth", weights_only=True)["lit_minimind"]["ranks"]
    assert not torch.equal(*[state["rng"]["torch"] for state in ranks]), "both ranks drew the same numbers"
    kls = [float(v) for v in re.findall(r"Approx KL: ([0-9.]+)", ref.stdout)]
    assert len(kls) == 6 and max(kls) > 0.002  # the early stop (--model.early_stop_kl 0.002) taken on some step
    killed = run_cli(killed_dir, ddp, env=cli_env(LIT_MINIMIND_TEST_STOP_IN_SAVE="4:checkpoint"))
    assert killed.returncode == -9
    where = expected_resume(killed_dir, "ppo_actor_64", iters=2)
    assert where == (2, 2)  # the fourth save (epoch 2, step 2) never committed: mid-epoch, streams restored
    resumed = run_cli(killed_dir, ddp + ["--ckpt_path", "last"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_resumed(resumed, *where)
    assert resumed.steps == {k: v for k, v in ref.steps.items() if k >= where}
    assert_same_files(ref_dir, killed_dir, ["out/ppo_actor_64.pth", "checkpoints/ppo_actor_64_resume.pth"])
