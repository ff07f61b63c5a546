"""MiniMind's PPO stage (``trainer/train_ppo.py``): actor, critic, GAE, the clipped policy and value losses.

Each batch of prompts is one rollout, then ``ppo_update_iters`` passes over it in minibatches (:func:`ppo_step`):

1. **rollout**: every prompt sampled once by the actor (:func:`lit_minimind.model.grpo.rollout`: temperature 0.8,
   top-k 50, top-p 0.85, KV cache), the old log-probs of the completion from a no-grad forward of the actor
   (MiniMind's rollout engine: ``logits_to_keep = R + 1``), the rewards of :func:`lit_minimind.model.grpo.rewards_of`
   (rule terms + scorer);
2. **values**: the critic (:class:`CriticModel`: the backbone with a scalar head, started from the actor's
   weights, its head initialised as MiniMind's: :func:`critic_head_init`) at the positions before each completion
   token, the reference's log-probs, the reward added at each completion's last token (up to its first EOS);
3. **GAE** (:func:`gae`): ``delta_t = r_t + gamma V_{t+1} - V_t``, ``A_t = delta_t + gamma lam A_{t+1}``; returns
   ``A + V``; the advantages whitened over the completion tokens (:func:`whiten`);
4. **updates**: ``ppo_update_iters`` passes, each over a ``torch.randperm`` of the rows in ``mini_batch_size``
   minibatches (:func:`ppo_losses`): the clipped policy loss plus ``kl_coef`` times the k3 KL to the reference,
   the clipped value loss (``cliprange_value``) times ``vf_coef``; MiniMind's early stop: once a minibatch's
   ``0.5 * mean(log_ratio^2)`` (the mean over DDP's processes: :func:`agreed_kl`) exceeds ``early_stop_kl``, its
   loss and the rest of the pass count zero (a zero backward, the optimizers still step) and no further pass runs.
   Both optimizers step together every ``accumulation_steps`` minibatches (a counter over the epoch) and at the
   rollout's end, each with its gradients clipped to ``grad_clip``, each LR cosine-annealed to a tenth over
   :func:`total_updates`. Under DDP every ``manual_backward`` all-reduces both models' gradients.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from lit_minimind.checkpoint.names import PPO_STATE_KEY
from lit_minimind.model.minimind import MiniMindConfig, MiniMindForCausalLM, SkipWeightInit
from lit_minimind.model.reward import RewardModel
from lit_minimind.model.schedules import annealed_lr, save_minimind_scheduler

__all__ = ["PPO_DEFAULTS", "PPO_STATE_KEY", "CriticModel", "agreed_kl", "build_critic", "critic_head_init",
           "gae", "load_ppo_state", "old_log_probs", "ppo_losses", "ppo_step", "ppo_trainer_problem",
           "save_ppo_state", "step_optimizers", "total_updates", "whiten"]

# train_ppo.py's defaults of its own flags
PPO_DEFAULTS = {"critic_learning_rate": 5e-7, "kl_coef": 0.02, "clip_epsilon": 0.2, "vf_coef": 0.5, "gamma": 1.0,
                "lam": 0.95, "cliprange_value": 0.2, "ppo_update_iters": 2, "early_stop_kl": 0.25, "mini_batch_size": 2}


class CriticModel(RewardModel):
    """MiniMind's ``CriticModel``: the causal LM's backbone with ``value_head`` (a value per position)."""

    def values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``(B, T)`` values: ``value_head(model.norm(hidden))``, as MiniMind's critic's forward."""
        hidden, _, _ = self.model(input_ids, attention_mask)
        return self.value_head(self.model.norm(hidden)).squeeze(-1)


def critic_head_init(config: MiniMindConfig, seed: int) -> dict[str, torch.Tensor]:
    """The critic's ``value_head`` as MiniMind's run initialises it: after ``setup_seed(seed)`` MiniMind builds the
    actor, the reference and the critic (each drawing its initial weights), and only the value head keeps its
    draws (the rest is loaded from ``--from_weight``). Replayed on a forked stream: the training's is untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        MiniMindForCausalLM(config)  # the actor's draws
        MiniMindForCausalLM(config)  # the reference's
        critic = CriticModel(config)
    return {k: v.clone() for k, v in critic.value_head.state_dict().items()}


def build_critic(config: MiniMindConfig, seed: int) -> CriticModel:
    """A critic with MiniMind's initial value head; its backbone left for ``--from_weight`` (no draws)."""
    with torch.random.fork_rng(devices=[]), SkipWeightInit():
        critic = CriticModel(config)
    critic.value_head.load_state_dict(critic_head_init(config, seed))
    return critic


def total_updates(iters: int, epochs: int, batch_size: int, mini_batch_size: int, update_iters: int,
                  accumulation: int) -> int:
    """MiniMind's ``T_max``: ``ceil(iters * epochs * update_iters * ceil(batch / minibatch) / accumulation)``."""
    mb_factor = max(1, math.ceil(batch_size / mini_batch_size))
    return math.ceil(iters * epochs * update_iters * mb_factor / accumulation)


def gae(token_rewards: torch.Tensor, values: torch.Tensor, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, returns)`` ``(B, R)`` by generalised advantage estimation, ``V`` after the last token 0."""
    length = values.shape[1]
    last = torch.zeros(values.shape[0], device=values.device, dtype=values.dtype)
    reversed_advs = []
    for t in reversed(range(length)):
        next_value = values[:, t + 1] if t < length - 1 else 0.0
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        last = delta + gamma * lam * last
        reversed_advs.append(last)
    advantages = torch.stack(reversed_advs[::-1], dim=1)
    return advantages, advantages + values


def whiten(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(A - mean) / sqrt(var + 1e-8)`` over the masked tokens (population variance), 0 elsewhere."""
    count = mask.sum().clamp(min=1)
    mean = (advantages * mask).sum() / count
    var = ((advantages - mean) ** 2 * mask).sum() / count
    return (advantages - mean) * torch.rsqrt(var + 1e-8) * mask


def ppo_losses(logps: torch.Tensor, old_logps: torch.Tensor, ref_logps: torch.Tensor, values: torch.Tensor,
               old_values: torch.Tensor, advantages: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip_epsilon: float, cliprange_value: float, kl_coef: float) -> dict[str, torch.Tensor]:
    """One minibatch's ``policy_loss`` (clipped surrogate + ``kl_coef`` * k3 KL to the reference), ``value_loss``
    (clipped), ``approx_kl`` (``0.5 * log_ratio^2``), ``clipfrac`` and ``kl_ref``: token means over ``mask``."""
    count = mask.sum().clamp(min=1)
    log_ratio = logps - old_logps
    approx_kl = (0.5 * log_ratio ** 2 * mask).sum() / count
    ratio = torch.exp(log_ratio)
    clipfrac = (((ratio - 1.0).abs() > clip_epsilon).float() * mask).sum() / count
    diff = ref_logps - logps
    kl_ref = ((torch.exp(diff) - diff - 1.0) * mask).sum() / count
    surrogate = torch.max(-advantages * ratio, -advantages * torch.clamp(ratio, 1.0 - clip_epsilon, 1.0 + clip_epsilon))
    policy_loss = (surrogate * mask).sum() / count + kl_coef * kl_ref
    clipped = torch.clamp(values, old_values - cliprange_value, old_values + cliprange_value)
    value_loss = 0.5 * (torch.max((values - returns) ** 2, (clipped - returns) ** 2) * mask).sum() / count
    return {"policy_loss": policy_loss, "value_loss": value_loss, "approx_kl": approx_kl.detach(),
            "clipfrac": clipfrac.detach(), "kl_ref": kl_ref.detach()}


# ----------------------------------------------------------------------------- the training step (LitMiniMind's)



def old_log_probs(model: Any, outputs: torch.Tensor, attention: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """The rollout's log-probs of the completion (no gradients), as MiniMind's engine: ``logits_to_keep = R + 1``."""
    from lit_minimind.model.grpo import completion_log_probs

    n = outputs.shape[1] - prompt_len
    with torch.no_grad():
        logits = model(outputs, attention_mask=attention, logits_to_keep=n + 1).logits
    return completion_log_probs(logits, outputs[:, prompt_len - 1:], 1)


def step_optimizers(module: Any, updates: int) -> None:
    """Clip each model's gradients, step both optimizers at the LR of ``updates`` steps taken, zero the gradients.
    The actor's step goes through Lightning (``trainer.global_step`` counts the updates), the critic's directly."""
    hp = module.hparams
    actor, critic = module.optimizers()
    total = module.lr_total()
    for opt, peak in ((actor, hp.learning_rate), (critic, hp.critic_learning_rate)):
        for group in opt.param_groups:
            group["lr"] = annealed_lr(updates, total, peak)
        module.clip_gradients(opt, gradient_clip_val=hp.grad_clip, gradient_clip_algorithm="norm")
    actor.step()
    critic.optimizer.step()
    actor.zero_grad()
    critic.zero_grad()


def agreed_kl(module: Any, approx_kl: torch.Tensor) -> torch.Tensor:
    """The minibatch's approximate KL averaged over the processes (MiniMind's ``all_reduce(AVG)``): every rank
    takes the same early-stop decision, so all run the same number of backward passes (DDP's collectives)."""
    if module.trainer.world_size == 1:
        return approx_kl
    return module.trainer.strategy.reduce(approx_kl.detach().clone(), reduce_op="mean")


def ppo_step(module: Any, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
    """One rollout of the batch's prompts and MiniMind's PPO updates on it (module docstring)."""
    from lit_minimind.data.tokenizer import EOS_ID, PAD_ID
    from lit_minimind.model.grpo import completion_log_probs, completion_mask, rewards_of, rollout

    hp, model, critic = module.hparams, module.model, module.critic
    ids, prompts = batch["input_ids"], batch["prompts"]
    if module.prepare_rollout_stream(ids, batch_idx):  # an epoch's start (or MiniMind's resume): a fresh counter
        module.ppo_state["minibatches"] = 0
    outputs = rollout(model, ids, batch["attention_mask"], 1, hp.max_gen_len)
    prompt_len, rows = ids.shape[1], ids.shape[0]
    completion_ids = outputs[:, prompt_len:]
    texts = module.trainer.datamodule.tokenizer.decode_batch(completion_ids.tolist(), skip_special_tokens=True)
    rewards = rewards_of(prompts, texts, 1, module.scorer).to(ids.device)
    attention = (outputs != PAD_ID).long()
    mask = completion_mask(completion_ids, EOS_ID).float()
    lengths = mask.sum(dim=1).long()
    old_logps = old_log_probs(model, outputs, attention, prompt_len)
    with torch.no_grad():
        old_values = critic.values(outputs, attention)[:, prompt_len - 1:-1] * mask
        ref_logits = module.reference.logits(outputs, like=next(model.parameters()), attention_mask=attention)
        ref_logps = completion_log_probs(ref_logits, outputs, prompt_len)
        token_rewards = torch.zeros_like(old_logps)
        token_rewards[torch.arange(rows, device=ids.device), lengths - 1] += rewards
        advantages, returns = gae(token_rewards, old_values, hp.gamma, hp.lam)
        advantages = whiten(advantages, mask)

    mb_size = max(1, min(hp.mini_batch_size, rows))
    sums = dict.fromkeys(("policy_loss", "value_loss", "approx_kl", "kl_ref", "clipfrac", "aux_loss"), 0.0)
    count, stop = 0, False
    state = module.ppo_state
    for _ in range(hp.ppo_update_iters):
        if stop:
            break
        order = torch.randperm(rows, device=ids.device)
        for start in range(0, rows, mb_size):
            inds = order[start:start + mb_size]
            values = critic.values(outputs[inds], attention[inds])[:, prompt_len - 1:-1]
            out = model(outputs[inds], attention_mask=attention[inds])
            aux_loss = out.aux_loss if module.config.use_moe else torch.zeros((), device=ids.device)
            logps = completion_log_probs(out.logits, outputs[inds], prompt_len)
            losses = ppo_losses(logps, old_logps[inds], ref_logps[inds], values, old_values[inds], advantages[inds],
                                returns[inds], mask[inds], hp.epsilon, hp.cliprange_value, module.beta)
            losses["approx_kl"] = agreed_kl(module, losses["approx_kl"])
            if float(losses["approx_kl"]) > hp.early_stop_kl:
                stop = True
            loss = losses["policy_loss"] + hp.vf_coef * losses["value_loss"] + aux_loss
            module.manual_backward(loss * 0.0 if stop else loss / hp.accumulation_steps)
            for key in sums:
                sums[key] += float((losses[key] if key != "aux_loss" else aux_loss).detach())
            count += 1
            state["minibatches"] += 1
            if state["minibatches"] % hp.accumulation_steps == 0:
                step_optimizers(module, state["updates"])
                state["updates"] += 1
    if state["minibatches"] % hp.accumulation_steps != 0:
        step_optimizers(module, state["updates"])
        state["updates"] += 1
    total = module.lr_total()
    mean = {k: torch.tensor(v / max(count, 1)) for k, v in sums.items()}
    module.last_stats = {"loss": mean["policy_loss"], "aux_loss": mean["aux_loss"], "reward": rewards.mean().cpu(),
                         "kl_ref": mean["kl_ref"], "approx_kl": mean["approx_kl"], "clipfrac": mean["clipfrac"],
                         "critic_loss": mean["value_loss"], "avg_response_len": lengths.float().mean().cpu(),
                         "critic_lr": torch.tensor(annealed_lr(state["updates"], total, hp.critic_learning_rate),
                                                   dtype=torch.float64),
                         "lr": annealed_lr(state["updates"], total, hp.learning_rate)}
    module.rollout_log = {"completion_ids": completion_ids, "rewards": rewards}
    return mean["policy_loss"]


def ppo_trainer_problem(trainer: Any) -> str | None:
    """What PPO cannot run under (None: it can): fp16 with a grad scaler."""
    if getattr(trainer.precision_plugin, "scaler", None) is not None:
        return ("PPO with --trainer.precision 16-mixed is not supported (MiniMind's train_ppo.py uses no grad scaler): "
                "use bf16-mixed or 32-true")
    return None


def save_ppo_state(module: Any, checkpoint: dict[str, Any]) -> None:
    """The PPO counters, and MiniMind's keys of its PPO resume file beside Lightning's: ``critic_model`` (fp32, as
    MiniMind's), ``critic_optimizer``, ``scheduler`` and ``critic_scheduler`` (its CosineAnnealingLR states)."""
    hp, updates = module.hparams, module.ppo_state["updates"]
    checkpoint[PPO_STATE_KEY] = dict(module.ppo_state)
    state = checkpoint.get("state_dict") or {}
    checkpoint["critic_model"] = {k[len("critic."):]: v for k, v in state.items() if k.startswith("critic.")}
    optimizers = checkpoint.get("optimizer_states") or []
    if len(optimizers) == 2:
        checkpoint["critic_optimizer"] = optimizers[1]
    if math.isfinite(module.trainer.num_training_batches):
        total = module.lr_total()
        for key, opt, peak in (("scheduler", 0, hp.learning_rate), ("critic_scheduler", 1, hp.critic_learning_rate)):
            save_minimind_scheduler(checkpoint, key, opt, updates, total, peak)


def load_ppo_state(module: Any, checkpoint: dict[str, Any]) -> None:
    """Our checkpoint: the counters. MiniMind's PPO resume file (no counters, no RNG): the critic, its optimizer,
    the update count of its scheduler, and the epoch's accumulation counter at 0 (MiniMind's resumed run starts
    it afresh)."""
    saved = checkpoint.get(PPO_STATE_KEY)
    if saved is not None:
        module.ppo_state = {"updates": int(saved["updates"]), "minibatches": int(saved["minibatches"])}
        return
    state = checkpoint.setdefault("state_dict", {})
    if "critic_model" in checkpoint:
        for key, value in checkpoint["critic_model"].items():
            state["critic." + key] = value.float()
    optimizers = checkpoint.get("optimizer_states") or []
    if len(optimizers) == 1 and "critic_optimizer" in checkpoint:
        optimizers.append(checkpoint["critic_optimizer"])
    updates = int((checkpoint.get("scheduler") or {}).get("last_epoch", 0))
    module.ppo_state = {"updates": updates, "minibatches": 0}
