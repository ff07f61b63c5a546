"""MiniMind's reinforcement stage (``trainer/train_grpo.py``): rollouts, rule rewards, GRPO and CISPO losses.

Each micro-batch of prompts is one rollout, trained on at once (MiniMind's loop; its optimizer steps every
``accumulation_steps`` rollouts):

1. **rollout** (:func:`rollout`): each left-padded prompt is repeated ``num_generations`` times and
   sampled by the policy itself at MiniMind's settings (temperature 0.8, and its ``generate`` defaults
   top-k 50, top-p 0.85), through :meth:`MiniMindForCausalLM.generate` with a KV cache; a finished
   sequence is padded with EOS, as MiniMind's;
2. **rewards** (:func:`rule_rewards` + a scorer): MiniMind's ``calculate_rewards``: length 20-800
   characters +0.5 else -0.5; with ``</think>``: thinking 20-300 characters +1 else -0.5, exactly one
   ``</think>`` +0.25 else -0.25; minus a 3-gram repetition penalty (:func:`rep_penalty`, at most 0.5);
   plus the scorer's value of the answer (:func:`load_scorer`: a reward model of ours or a transformers
   directory such as MiniMind's InternLM2 reward; 0 with ``--model.reward_model none``);
3. **advantages**: per prompt group ``(r - mean) / (std + 1e-4)`` (population std);
4. **loss** (:func:`policy_loss`): token log-probs of the completion under the policy (with gradients) and
   the frozen reference, both in fp32, over the completion up to and including its first EOS:
   ``cispo``: ``-(sg(min(ratio, epsilon_high)) * A * logp - beta * KL)``; ``grpo``: PPO's clipped
   ``-(min(ratio * A, clip(ratio, 1 +- epsilon) * A) - beta * KL)``, with the k3 estimator
   ``KL = exp(ref - logp) - (ref - logp) - 1``; a per-sequence token mean, then the batch mean.

The ratio's "old" policy is the policy that sampled, which is the one being trained: a rollout is
trained on before any optimizer step, so ``old = sg(logp)`` and the ratio is 1 in value, its
gradient ``A * grad logp``. MiniMind obtains the old log-probs from a second no-grad forward, equal to
these up to float rounding (the loss agrees to ~1e-7); the port spares that forward.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from lit_minimind.data.tokenizer import EOS_ID

__all__ = ["GRPO_BETA", "LOSS_TYPES", "RewardScorer", "TransformersScorer", "completion_log_probs", "completion_mask",
           "fold_history", "group_advantages", "load_scorer", "per_token_policy_loss", "policy_loss", "prompt_messages",
           "rep_penalty", "rewards_of", "rollout", "rule_rewards", "seed_rollout_stream"]

GRPO_BETA = 0.1  # MiniMind's --beta of train_grpo.py
LOSS_TYPES = ("cispo", "grpo")
ROLLOUT_TEMPERATURE = 0.8  # train_grpo.py passes it to the rollout engine
ROLLOUT_TOP_K, ROLLOUT_TOP_P = 50, 0.85  # MiniMind's generate() defaults, which its rollout engine keeps
SCORE_CLIP = 3.0  # MiniMind's LMForRewardModel clips every score to [-3, 3]
THINK_END = "</think>"


def rep_penalty(text: str, n: int = 3, cap: float = 0.5) -> float:
    """MiniMind's repetition penalty: the share of repeated word n-grams, scaled to at most ``cap``."""
    toks = re.findall(r"\w+|[^\w\s]", text.lower())
    grams = [tuple(toks[i:i + n]) for i in range(len(toks) - n + 1)]
    return min(cap, (len(grams) - len(set(grams))) * cap * 2 / len(grams)) if grams else 0.0


def rule_rewards(response: str) -> tuple[float, str]:
    """MiniMind's rule terms of one completion, and the answer the scorer judges (after ``</think>``)."""
    reward = 0.5 if 20 <= len(response.strip()) <= 800 else -0.5
    answer = response
    if THINK_END in response:
        thinking, rest = response.split(THINK_END, 1)
        reward += 1.0 if 20 <= len(thinking.strip()) <= 300 else -0.5
        reward += 0.25 if response.count(THINK_END) == 1 else -0.25
        answer = rest.strip()
    return reward - rep_penalty(answer), answer


def prompt_messages(prompt: str) -> list[dict[str, str]]:
    """The messages of a rendered prompt (MiniMind parses them back with this pattern for its scorer)."""
    pattern = r"<\|im_start\|>(system|user|assistant)\s+(.*?)<\|im_end\|>"
    return [{"role": role, "content": content.strip()} for role, content in re.findall(pattern, prompt, re.DOTALL)]


def group_advantages(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """``(r - mean) / (std + 1e-4)`` within each prompt's group of ``num_generations`` samples."""
    grouped = rewards.view(-1, num_generations)
    mean = grouped.mean(dim=1).repeat_interleave(num_generations)
    std = grouped.std(dim=1, unbiased=False).repeat_interleave(num_generations)
    return (rewards - mean) / (std + 1e-4)


def completion_mask(completion_ids: torch.Tensor, eos_id: int = EOS_ID) -> torch.Tensor:
    """1 on every completion token up to and including the first EOS (all of them without one)."""
    is_eos = completion_ids == eos_id
    length = completion_ids.shape[1]
    first = torch.where(is_eos.any(dim=1), is_eos.int().argmax(dim=1), torch.full_like(is_eos[:, 0], length - 1,
                                                                                         dtype=torch.long))
    return (torch.arange(length, device=completion_ids.device)[None, :] <= first[:, None]).int()


@torch.no_grad()
def rollout(model: Any, prompt_ids: torch.Tensor, attention_mask: torch.Tensor, num_generations: int,
            max_new_tokens: int) -> torch.Tensor:
    """``(B * G, P + R)``: every prompt (left-padded) repeated ``num_generations`` times and sampled by
    ``model`` from torch's global stream (MiniMind's ``TorchRolloutEngine``)."""
    out = model.generate(prompt_ids.repeat_interleave(num_generations, dim=0), max_new_tokens=max_new_tokens,
                         temperature=ROLLOUT_TEMPERATURE, top_p=ROLLOUT_TOP_P, top_k=ROLLOUT_TOP_K, eos_token_id=EOS_ID,
                         attention_mask=attention_mask.repeat_interleave(num_generations, dim=0))
    return out.clone()  # generate runs in inference mode; the training forward needs a normal tensor


def completion_log_probs(logits: torch.Tensor, outputs: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """fp32 log-probs ``(B, R)`` of the completion tokens ``outputs[:, prompt_len:]`` from full-sequence
    ``logits`` (position ``t`` predicts token ``t + 1``)."""
    logits = logits[:, prompt_len - 1:-1, :].float()
    return torch.gather(F.log_softmax(logits, dim=-1), 2, outputs[:, prompt_len:].unsqueeze(-1)).squeeze(-1)


def per_token_policy_loss(logps: torch.Tensor, ref_logps: torch.Tensor, advantages: torch.Tensor, loss_type: str,
                          beta: float, epsilon: float, epsilon_high: float,
                          old_logps: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The GRPO / CISPO loss of every token (module docstring), unmasked, and ``ref_logps - logps``; the ratio's
    old policy is ``old_logps`` (the rollout's own log-probs: agent RL, whose training context can differ from
    the rollout's), else ``sg(logps)``."""
    diff = ref_logps - logps
    per_token_kl = torch.exp(diff) - diff - 1
    # without old_logps the ratio is 1 in value: the rollout's policy is the trained one
    ratio = torch.exp(logps - (logps.detach() if old_logps is None else old_logps))
    adv = advantages.unsqueeze(1)
    if loss_type == "cispo":
        per_token = -(torch.clamp(ratio, max=epsilon_high).detach() * adv * logps - beta * per_token_kl)
    else:
        clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon)
        per_token = -(torch.min(ratio * adv, clipped * adv) - beta * per_token_kl)
    return per_token, diff


def policy_loss(logps: torch.Tensor, ref_logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                loss_type: str, beta: float, epsilon: float, epsilon_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """MiniMind's GRPO / CISPO loss (module docstring) and its console's KL to the reference (detached)."""
    per_token, diff = per_token_policy_loss(logps, ref_logps, advantages, loss_type, beta, epsilon, epsilon_high)
    maskf = mask.float()
    loss = ((per_token * maskf).sum(dim=1) / maskf.sum(dim=1).clamp(min=1)).mean()
    kl_ref = (diff.detach() * maskf).sum() / maskf.sum().clamp(min=1)
    return loss, kl_ref


RANK_SEED_STRIDE = 1 << 20  # rank r > 0 seeds its stream this far from rank 0's


def seed_rollout_stream(epoch: int, num_samples: int, device: torch.device, rank: int = 0, seed: int = 42) -> None:
    """Put torch's global stream where MiniMind's is at an epoch's first rollout: ``setup_seed(42 + epoch)``,
    then (on the CPU stream) its ``torch.randperm(len(train_ds))`` and the DataLoader iterator's base-seed
    draw. A CUDA rollout draws from the CUDA stream, which those two CPU draws leave alone.

    MiniMind seeds every DDP rank alike, so its ranks draw the same numbers for their different prompts; here
    rank ``r > 0`` seeds ``r * RANK_SEED_STRIDE`` further on and samples independently (rank 0 is MiniMind's)."""
    torch.manual_seed(seed + epoch + rank * RANK_SEED_STRIDE)
    if device.type == "cpu":
        torch.randperm(num_samples)
        torch.empty((), dtype=torch.int64).random_()


def fold_history(messages: list[dict[str, str]], answer: str) -> list[dict[str, str]]:
    """MiniMind's ``LMForRewardModel.get_score`` input: the history folded into one user turn, then the answer."""
    history = "\n".join(f"{m['role']}: {m['content']}" for m in messages[:-1])
    query = messages[-1]["content"] if messages else ""
    context = f"{history}\n以上是对话历史。我的新问题是：\n{query}" if history else query  # MiniMind's words
    return [{"role": "user", "content": context}, {"role": "assistant", "content": answer}]


class RewardScorer:
    """The reward model of ``--model.reward_model FILE``: a :class:`lit_minimind.model.reward.RewardModel` file
    (``--model.objective reward``), read once and frozen; ``get_score(messages, answer)`` renders
    :func:`fold_history`'s two turns with the chat template and reads the value at the closing ``<|im_end|>``,
    clipped to [-3, 3] as MiniMind's."""

    def __init__(self, path: str | os.PathLike[str], tokenizer: Any, chat_template: str | None) -> None:
        from lit_minimind.checkpoint.read import read_checkpoint
        from lit_minimind.checkpoint.weights import model_weights, shape_config
        from lit_minimind.errors import CheckpointError
        from lit_minimind.model.dpo import file_sha256
        from lit_minimind.model.minimind import MiniMindConfig
        from lit_minimind.model.reward import RewardModel

        state = model_weights(read_checkpoint(path))
        if "value_head.weight" not in state:
            raise CheckpointError(f"--model.reward_model: {path}: not a reward model (no value_head.weight: train one "
                                  "with --model.objective reward)")
        with torch.random.fork_rng(devices=[]):  # the weights are loaded over the initialisation: draw nothing
            self.model = RewardModel(MiniMindConfig(**{k: v for k, v in shape_config(state).items() if v is not None}))
        self.model.load_state_dict(state, strict=False)
        self.model.eval().requires_grad_(False)
        self.path, self.sha256 = Path(path), file_sha256(path)
        self.tokenizer, self.chat_template = tokenizer, chat_template

    @torch.no_grad()
    def get_score(self, messages: list[dict[str, str]], answer: str) -> float:
        from lit_minimind.data.chat_template import render_chat

        ids = self.tokenizer.encode(render_chat(fold_history(messages, answer), self.chat_template)).ids
        ends = [i for i, t in enumerate(ids) if t == EOS_ID]
        values, _ = self.model.scores(torch.tensor([ids[: ends[-1] + 1] if ends else ids]))
        return max(min(float(values[0, -1]), SCORE_CLIP), -SCORE_CLIP)


class TransformersScorer:
    """``--model.reward_model DIR``: a transformers reward model directory (MiniMind's InternLM2-1.8B-Reward),
    scored by :mod:`lit_minimind.model.hf_reward` in the Python ``python`` (one with transformers; kept out of
    this environment), one request per answer over a pipe; its ``get_score(tokenizer, messages)`` on
    :func:`fold_history`'s two turns, clipped to [-3, 3] as MiniMind's."""

    def __init__(self, path: str | os.PathLike[str], python: str | None) -> None:
        import subprocess
        import sys

        from lit_minimind.errors import UsageError
        from lit_minimind.model.dpo import file_sha256

        self.path, self.sha256 = Path(path), file_sha256(path)
        script = Path(__file__).with_name("hf_reward.py")
        self.process = subprocess.Popen([python or sys.executable, str(script), str(path)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True, encoding="utf-8")
        first = json.loads(self.process.stdout.readline() or '{"error": "the scorer process exited"}')
        if "error" in first:
            self.close()
            raise UsageError(f"--model.reward_model {path}: {first['error']} (a transformers reward model needs a "
                             "Python with transformers: --model.reward_python PATH, e.g. make test-hf's .venv-hf/bin/python)")

    def get_score(self, messages: list[dict[str, str]], answer: str) -> float:
        self.process.stdin.write(json.dumps({"messages": fold_history(messages, answer)}, ensure_ascii=False) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"--model.reward_model {self.path}: the scorer process exited "
                               f"(status {self.process.wait()}); its error is above")
        return max(min(float(json.loads(line)["score"]), SCORE_CLIP), -SCORE_CLIP)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def load_scorer(path: str | os.PathLike[str], tokenizer: Any, chat_template: str | None,
                python: str | None = None) -> RewardScorer | TransformersScorer:
    """``--model.reward_model``: a file of ours (:class:`RewardScorer`) or a transformers directory."""
    from lit_minimind.errors import CheckpointError

    if Path(path).is_dir():
        return TransformersScorer(path, python)
    if not Path(path).is_file():
        raise CheckpointError(f"--model.reward_model: {path}: no such file or directory (a reward model trained with "
                              "--model.objective reward, a transformers reward model directory, or none: rule rewards only)")
    return RewardScorer(path, tokenizer, chat_template)


def rewards_of(prompts: list[str], completions: list[str], num_generations: int,
               scorer: RewardScorer | TransformersScorer | None) -> torch.Tensor:
    """MiniMind's ``calculate_rewards``: the rule terms of each completion plus the scorer's value."""
    rewards = []
    for i, completion in enumerate(completions):
        reward, answer = rule_rewards(completion)
        if scorer is not None:
            reward += scorer.get_score(prompt_messages(prompts[i // num_generations]), answer)
        rewards.append(reward)
    return torch.tensor(rewards, dtype=torch.float32)

