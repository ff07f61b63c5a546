"""MiniMind's causal LM as a LightningModule: MiniMind's loss, optimizer and LR rule."""

from __future__ import annotations

import math
import os
import random
from typing import Any

import lightning as L
import torch
from torchmetrics.aggregation import MeanMetric

from lit_minimind.checkpoint.names import (
    LR_SCHEDULE_KEY,
    REWARD_MODEL_KEY,
    START_WEIGHTS_KEY,
    TEACHER_KEY,
    TRAINING_STATE_KEY,
)
from lit_minimind.checkpoint.read import read_checkpoint
from lit_minimind.checkpoint.weights import config_mismatches, model_weights, shape_config
from lit_minimind.data.sampler import MINIMIND_SEED
from lit_minimind.errors import CheckpointError, say
from lit_minimind.model import MiniMindConfig, MiniMindForCausalLM
from lit_minimind.model.distill import DISTILL_ALPHA, DISTILL_TEMPERATURE, distill_loss, load_teacher
from lit_minimind.model.dpo import DPO_BETA, Reference, dpo_inputs, dpo_loss, file_sha256, token_log_probs
from lit_minimind.model.grpo import (
    GRPO_BETA,
    LOSS_TYPES,
    RANK_SEED_STRIDE,
    completion_log_probs,
    completion_mask,
    group_advantages,
    load_scorer,
    policy_loss,
    rewards_of,
    rollout,
    seed_rollout_stream,
)
from lit_minimind.model.lora import apply_lora, freeze_base, is_lora_key
from lit_minimind.model.ppo import (
    PPO_DEFAULTS,
    build_critic,
    load_ppo_state,
    ppo_step,
    ppo_trainer_problem,
    save_ppo_state,
    total_updates,
)
from lit_minimind.model.reward import RewardModel, bradley_terry_loss
from lit_minimind.model.schedules import annealed_lr, minimind_lr, save_minimind_scheduler
from lit_minimind.resume.states import rank_rng_state

OBJECTIVES = ("auto", "lm", "dpo", "distill", "reward", "grpo", "ppo", "agent")
ROLLOUT_OBJECTIVES = ("grpo", "ppo", "agent")  # sample from the policy: a rollout stream, a scorer
REFERENCE_OBJECTIVES = ("dpo", *ROLLOUT_OBJECTIVES)  # a frozen reference built from --from_weight


def objective_data_problem(objective: str, kind: str) -> str | None:
    """Why ``objective`` cannot train on data of ``kind`` (None when it can)."""
    if (objective == "agent") != (kind == "agent"):
        return ("--model.objective agent rolls out tool calls: give agent RL records with --data.kind agent, not "
                f"--data.kind {kind}" if objective == "agent" else
                f"--data.kind agent holds tool-use questions for --model.objective agent, not for {objective}")
    if objective in ("grpo", "ppo"):
        return None if kind == "rlaif" else (f"--model.objective {objective} samples answers to prompts: give conversations with "
                                             f"--data.kind rlaif, not --data.kind {kind}")
    if kind == "rlaif":
        return f"--data.kind rlaif holds prompts for --model.objective grpo or ppo, not for {objective}"
    if (objective in ("dpo", "reward")) != (kind == "dpo"):
        return f"--model.objective {objective} trains on " + (
            "preference pairs: give DPO data (--data.kind dpo, or a file of chosen/rejected records)"
            if kind != "dpo" else f"SFT or pretraining data, not DPO pairs (--data.kind {kind})")
    return None


def seed_rank(seed: int) -> None:
    """MiniMind's ``setup_seed``: Python's, NumPy's and torch's (CPU and CUDA) generators."""
    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # every CUDA device too


class LitMiniMind(L.LightningModule):
    """MiniMind's training: loss = CE + MoE aux loss (pretraining, SFT, LoRA), MiniMind's DPO loss + MoE
    aux loss, or MiniMind's distillation loss; AdamW over the trainable parameters, LR set per micro-batch
    as MiniMind does.

    The stage is two settings: ``lora_rank`` (MiniMind's ``train_lora.py``: adapters on every square
    Linear, :mod:`lit_minimind.model.lora`, the rest frozen) and ``objective`` (``dpo``: MiniMind's
    ``train_dpo.py``, :mod:`lit_minimind.model.dpo`). LoRA and DPO runs keep something out of their
    checkpoints that :meth:`use_start_weights` (``--from_weight``) provides again on resume: the frozen
    base (LoRA) and the frozen reference model (DPO); its sha256 is recorded in every checkpoint and a
    resume with another file is refused. Distillation (``objective="distill"``, MiniMind's
    ``train_distillation.py``, :mod:`lit_minimind.model.distill`) trains every weight against a frozen
    ``teacher`` file, read again on resume and checked the same way.

    Args:
        hidden_size: width of the model (MiniMind's ``--hidden_size``: 512 small, 768 the default).
        num_hidden_layers: number of transformer blocks (MiniMind's ``--num_hidden_layers``).
        use_moe: mixture-of-experts feed-forward layers (MiniMind's ``--use_moe 1``).
        num_attention_heads: attention (query) heads per layer.
        num_key_value_heads: key/value heads per layer (grouped-query attention; must divide num_attention_heads).
        vocab_size: token embeddings; the tokenizer's vocabulary (MiniMind's 6400).
        num_experts: experts per MoE layer (with ``use_moe``).
        num_experts_per_tok: experts each token is routed to (with ``use_moe``).
        dropout: dropout probability in the model (MiniMind: 0).
        learning_rate: peak LR of MiniMind's cosine rule.
        warmup_steps: linear warmup in micro-batches (0 = MiniMind).
        weight_decay: AdamW weight decay (torch's default 0.01, as MiniMind).
        compile: ``torch.compile`` the model's forward (MiniMind's ``--use_compile 1``); its state dict,
            and so every checkpoint, keeps MiniMind's keys.
        lora_rank: 0 (default) trains every weight; ``r > 0`` trains only rank-``r`` LoRA adapters
            (MiniMind: 16). The state dict, so checkpoints and the fp16 export, holds only the adapters.
        objective: ``lm`` (next-token CE), ``dpo`` (preference pairs), ``distill`` (SFT data against a
            teacher), ``reward`` (a reward model on preference pairs: :mod:`lit_minimind.model.reward`) or
            ``auto``: ``dpo`` on DPO data, else ``lm``.
        beta: DPO's beta (MiniMind's ``--beta`` 0.15), or GRPO's KL weight (``train_grpo.py``'s ``--beta`` 0.1);
            default: the objective's.
        alpha: distillation's CE weight; the KL term has ``1 - alpha`` (MiniMind's ``--alpha`` 0.5).
        temperature: distillation's softmax temperature (MiniMind's ``--temperature`` 1.5).
        teacher: distillation's teacher, a MiniMind weight file of any size, dense or MoE (the CLI also takes
            MiniMind's NAME: ``{resume.out_dir}/{NAME}_{hidden}[_moe].pth``).
        teacher_hidden_size: the teacher's width, checked against its file (and the NAME's ``{hidden}``;
            default: the student's).
        teacher_num_layers: the teacher's depth, checked against its file.
        teacher_use_moe: whether the teacher is MoE, checked against its file (and the NAME's ``_moe``).
        loss_type: GRPO's loss, ``cispo`` (MiniMind's default) or ``grpo`` (:mod:`lit_minimind.model.grpo`).
        num_generations: GRPO: samples per prompt (MiniMind's ``--num_generations`` 6).
        epsilon: GRPO's PPO clip (``--epsilon`` 0.2, ``loss_type grpo``).
        epsilon_high: CISPO's ratio cap (``--epsilon_high`` 5.0).
        max_gen_len: GRPO: tokens per sample at most (``--max_gen_len``).
        reward_model: GRPO's scorer, added to MiniMind's rule rewards: a reward model file
            (``--model.objective reward``) or a transformers reward model directory (MiniMind's InternLM2 reward,
            scored in ``reward_python``); ``none``: the rule rewards alone.
        reward_python: the Python (with transformers) that scores a transformers ``reward_model`` directory;
            default: this one.
        critic_learning_rate: PPO: the critic's peak LR (``train_ppo.py``'s ``--critic_learning_rate`` 5e-7); the
            actor's is ``learning_rate``, its clip ``epsilon`` (``--clip_epsilon``), its KL weight ``beta``
            (``--kl_coef`` 0.02) (:mod:`lit_minimind.model.ppo`).
        vf_coef: PPO: the value loss's weight (``--vf_coef`` 0.5).
        gamma: PPO: GAE's discount (``--gamma`` 1.0).
        lam: PPO: GAE's lambda (``--lam`` 0.95).
        cliprange_value: PPO: the value clip around the rollout's values (``--cliprange_value`` 0.2).
        ppo_update_iters: PPO: passes over each rollout (``--ppo_update_iters`` 2).
        early_stop_kl: PPO: a minibatch's approximate KL above it ends the passes (``--early_stop_kl`` 0.25).
        mini_batch_size: PPO: rows per update (``--mini_batch_size`` 2).
        accumulation_steps: PPO: minibatches per optimizer step (MiniMind's ``--accumulation_steps``; PPO steps its
            optimizers itself, so the CLI moves ``--trainer.accumulate_grad_batches`` here).
        max_total_len: agent RL: tokens of a packed trajectory at most, its last kept (``train_agent.py``'s
            ``--max_total_len`` 2500; :mod:`lit_minimind.model.agent`; the stage: ``--model.objective agent``).
        grad_clip: PPO: the gradient norm clip of each model (``--grad_clip``; moved here from
            ``--trainer.gradient_clip_val`` by the CLI).
    """

    def __init__(
        self,
        hidden_size: int = 768,
        num_hidden_layers: int = 8,
        use_moe: bool = False,
        num_attention_heads: int = 8,
        num_key_value_heads: int = 4,
        vocab_size: int = 6400,
        num_experts: int = 4,
        num_experts_per_tok: int = 1,
        dropout: float = 0.0,
        learning_rate: float = 5e-4,
        warmup_steps: int = 0,
        weight_decay: float = 0.01,
        compile: bool = False,
        lora_rank: int = 0,
        objective: str = "auto",
        beta: float | None = None,
        alpha: float = DISTILL_ALPHA,
        temperature: float = DISTILL_TEMPERATURE,
        teacher: str | None = None,
        teacher_hidden_size: int | None = None,
        teacher_num_layers: int | None = None,
        teacher_use_moe: bool | None = None,
        loss_type: str = "cispo",
        num_generations: int = 6,
        epsilon: float = 0.2,
        epsilon_high: float = 5.0,
        max_gen_len: int = 1024,
        reward_model: str = "none",
        reward_python: str | None = None,
        critic_learning_rate: float = PPO_DEFAULTS["critic_learning_rate"],
        vf_coef: float = PPO_DEFAULTS["vf_coef"],
        gamma: float = PPO_DEFAULTS["gamma"],
        lam: float = PPO_DEFAULTS["lam"],
        cliprange_value: float = PPO_DEFAULTS["cliprange_value"],
        ppo_update_iters: int = PPO_DEFAULTS["ppo_update_iters"],
        early_stop_kl: float = PPO_DEFAULTS["early_stop_kl"],
        mini_batch_size: int = PPO_DEFAULTS["mini_batch_size"],
        accumulation_steps: int = 1,
        grad_clip: float = 1.0,
        max_total_len: int = 2500,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.config = MiniMindConfig(
            hidden_size=hidden_size,
            num_hidden_layers=num_hidden_layers,
            use_moe=use_moe,
            num_attention_heads=num_attention_heads,
            num_key_value_heads=num_key_value_heads,
            vocab_size=vocab_size,
            num_experts=num_experts,
            num_experts_per_tok=num_experts_per_tok,
            dropout=dropout,
        )
        self.model = (RewardModel if objective == "reward" else MiniMindForCausalLM)(self.config)
        if objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
        if lora_rank < 0:
            raise ValueError(f"lora_rank must be >= 0, got {lora_rank}")
        self.objective = objective
        if lora_rank:  # right after the model, as MiniMind: the adapters' init draws follow the model's
            apply_lora(self.model, lora_rank)
            freeze_base(self.model)
            self.strict_loading = False  # checkpoints hold the adapters; the base comes from --from_weight
        self.start_weights: dict[str, str] | None = None  # {"path", "sha256"} of --from_weight
        self.reference: Reference | None = None  # DPO: a plain attribute, not a submodule (see Reference)
        self.teacher: Reference | None = None  # distillation: the same
        if objective == "distill" and not 0 <= alpha <= 1:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        if objective == "distill" and temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {', '.join(LOSS_TYPES)}, got {loss_type!r}")
        if objective == "agent" and max_total_len < 2:
            raise ValueError(f"agent RL needs max_total_len >= 2, got {max_total_len}")
        if objective in ("grpo", "agent") and (num_generations < 2 or max_gen_len < 1):
            raise ValueError(f"GRPO needs num_generations >= 2 (a group to compare) and max_gen_len >= 1, got "
                             f"{num_generations} and {max_gen_len}")
        self.beta = beta if beta is not None else {"grpo": GRPO_BETA, "agent": GRPO_BETA, "ppo": PPO_DEFAULTS["kl_coef"]}.get(objective, DPO_BETA)
        self.critic = None  # PPO: MiniMind's CriticModel, a submodule (checkpointed, its own optimizer)
        if objective == "ppo":
            if min(ppo_update_iters, mini_batch_size, accumulation_steps, max_gen_len) < 1:
                raise ValueError("PPO needs ppo_update_iters, mini_batch_size, accumulation_steps and max_gen_len >= 1")
            self.critic = build_critic(self.config, int(os.environ.get("PL_GLOBAL_SEED", MINIMIND_SEED)))
            self.automatic_optimization = False  # two optimizers, several updates per rollout
        self.ppo_state = {"updates": 0, "minibatches": 0}  # PPO: optimizer steps so far, the epoch's minibatch count
        self.scorer = None  # GRPO's reward model (a RewardScorer), held outside the modules as the reference
        self._stream_epoch: int | None = None  # GRPO: the epoch whose rollout stream this process has set up
        self._rng_restored = False  # GRPO: whether a resume gave this rank its saved RNG state
        self._saved_lr_total: int | None = None  # the LR rule's T of the run a resume continues
        # as MiniMind: DDP leaves the RoPE tables alone (constants on every rank, not state to broadcast)
        self._ddp_params_and_buffers_to_ignore = [n for n, _ in self.named_buffers() if n.endswith(("freqs_cos", "freqs_sin"))]
        if compile:
            self.model.compile()  # in place: no ``_orig_mod.`` wrapper, state dict keys unchanged
        # the epoch's mean training loss and the validation loss, reduced across ranks at compute (no host
        # sync per batch: NaN checks off). The training mean is checkpointed (in the state dict): a resume
        # inside an epoch continues it. Checkpoints without it (MiniMind's, older ones) start it empty.
        self.train_loss_mean = MeanMetric(nan_strategy="disable")
        self.train_loss_mean.persistent(True)
        self.val_loss_mean = MeanMetric(nan_strategy="disable")
        self.val_accuracy_mean = MeanMetric(nan_strategy="disable")  # the reward model's pairwise accuracy
        self.last_stats: dict[str, torch.Tensor] = {}

    def setup(self, stage: str) -> None:
        """Under DDP, rank ``r > 0`` draws (dropout) from its own stream seeded ``seed + r``, as MiniMind's
        ``setup_seed(42 + rank)``; rank 0 keeps the stream seeded before the model was built (the weights
        are rank 0's on every rank: DDP broadcasts them). A resume then restores each rank's own state."""
        if self.objective == "auto":
            self.objective = "dpo" if getattr(self.trainer.datamodule, "data_kind", None) == "dpo" else "lm"
        kind = getattr(self.trainer.datamodule, "data_kind", None)
        if kind is not None and (problem := objective_data_problem(self.objective, kind)):
            from lit_minimind.errors import UsageError

            raise UsageError(problem)
        if self.objective in REFERENCE_OBJECTIVES and self.reference is None:
            if self.start_weights is None:
                from lit_minimind.errors import UsageError

                raise UsageError(f"{self.objective.upper()} needs --from_weight: the frozen reference model is built "
                                 "from it (MiniMind: full_sft)")
            self.reference = self._build_reference(self.start_weights["path"], self.start_weights["sha256"])
            if self.critic is not None:  # MiniMind: the critic's backbone from the same file, its head as drawn
                self.critic.load_state_dict(model_weights(read_checkpoint(self.start_weights["path"])), strict=False)
        if self.objective == "distill" and self.teacher is None:
            if not self.hparams.teacher:
                from lit_minimind.errors import UsageError

                raise UsageError("distillation needs a teacher: --model.teacher PATH (MiniMind's --from_teacher_weight)")
            self.teacher = load_teacher(self.hparams.teacher, hidden_size=self.hparams.teacher_hidden_size,
                                        num_hidden_layers=self.hparams.teacher_num_layers,
                                        use_moe=self.hparams.teacher_use_moe)
        if self.objective in ROLLOUT_OBJECTIVES:
            self.setup_grpo()
        if self.objective == "ppo" and (problem := ppo_trainer_problem(self.trainer)):
            from lit_minimind.errors import UsageError

            raise UsageError(problem)
        rank = self.trainer.global_rank
        if rank > 0:
            seed_rank(int(os.environ.get("PL_GLOBAL_SEED", MINIMIND_SEED)) + rank)  # Lightning's seed_everything sets it

    def use_start_weights(self, path: str | os.PathLike[str]) -> None:
        """Record ``--from_weight`` (path and sha256) for a stage that needs it again on resume: the LoRA
        base (loaded into the model by the caller) and the DPO reference (built from it at setup)."""
        self.start_weights = {"path": str(path), "sha256": file_sha256(path)}
        self.reference = None

    @property
    def needs_start_weights(self) -> bool:
        """Whether a resume needs ``--from_weight`` too (what the checkpoints leave out)."""
        return bool(self.hparams.lora_rank) or self.objective in REFERENCE_OBJECTIVES

    def _build_reference(self, path: str, sha256: str) -> Reference:
        with torch.random.fork_rng(devices=[]):  # building it draws nothing from the training's stream
            model = MiniMindForCausalLM(self.config)
        model.load_state_dict(model_weights(read_checkpoint(path)), strict=False)
        return Reference(model, path, sha256)

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        """LoRA: only the adapters (the frozen base is ``--from_weight``'s, loaded again on resume)."""
        state = super().state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)
        if self.hparams.lora_rank:
            for key in [k for k in state if k.startswith(prefix + "model.") and not is_lora_key(k)]:
                del state[key]
        return state

    # ----------------------------------------------------------------- schedule
    def total_lr_steps(self) -> int:
        """``T`` of the LR rule: epochs x batches per epoch (micro-batches), or max_steps x accumulation."""
        trainer = self.trainer
        iters = int(trainer.num_training_batches)
        total = (trainer.max_epochs or 1) * iters if trainer.max_epochs and trainer.max_epochs > 0 else math.inf
        if trainer.max_steps and trainer.max_steps > 0:
            total = min(total, trainer.max_steps * trainer.accumulate_grad_batches)
        return max(1, int(total))

    def lr_total(self) -> int:
        """``T`` of this run's LR rule, in its own unit: micro-batches (MiniMind's rule), optimizer steps (GRPO's, PPO's)."""
        trainer, total = self.trainer, math.inf
        if self.objective == "ppo":
            hp = self.hparams
            total = total_updates(int(trainer.num_training_batches), max(trainer.max_epochs or 1, 1),
                                  self.trainer.datamodule.batch_size, hp.mini_batch_size, hp.ppo_update_iters,
                                  hp.accumulation_steps)
            return max(min(total, trainer.max_steps) if trainer.max_steps and trainer.max_steps > 0 else total, 1)
        if self.objective not in ("grpo", "agent"):
            return self.total_lr_steps()
        if trainer.max_epochs and trainer.max_epochs > 0:
            total = math.ceil(int(trainer.num_training_batches) / trainer.accumulate_grad_batches) * trainer.max_epochs
        if trainer.max_steps and trainer.max_steps > 0:
            total = min(total, trainer.max_steps)
        return max(int(total), 1)

    def lr_schedule_change(self, saved_total: int, batch_idx: int) -> str | None:
        """At a resume's first batch (``batch_idx`` of the current epoch): the line saying the LR schedule differs
        from the saved run's (another epoch or step count changes ``T``, as in MiniMind), with this batch's LR under
        both; None when ``T`` is the same."""
        total, epoch = self.lr_total(), self.current_epoch
        if int(saved_total) == total:
            return None
        if self.objective in ("grpo", "agent"):
            steps = self.trainer.global_step
            lr = lambda t: annealed_lr(steps, t, self.hparams.learning_rate)  # noqa: E731
        elif self.objective == "ppo":
            lr = lambda t: annealed_lr(self.ppo_state["updates"], t, self.hparams.learning_rate)  # noqa: E731
        else:
            index = epoch * int(self.trainer.num_training_batches) + batch_idx + 1
            lr = lambda t: minimind_lr(index, t, self.hparams.learning_rate, self.hparams.warmup_steps)  # noqa: E731
        unit = "optimizer steps" if self.objective in ROLLOUT_OBJECTIVES else "steps"
        return (f"learning rate schedule: {saved_total} -> {total} total {unit} (another epoch or step count than the "
                f"checkpoint's run): lr {lr(int(saved_total)):.6g} -> {lr(total):.6g} at epoch {epoch + 1} step {batch_idx + 1}")

    def lr_at(self, epoch: int, step: int) -> float:
        """LR for the ``step``-th (1-based) micro-batch of ``epoch``."""
        iters = int(self.trainer.num_training_batches)
        return minimind_lr(epoch * iters + step, self.total_lr_steps(), self.hparams.learning_rate, self.hparams.warmup_steps)

    # ----------------------------------------------------------------- training
    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None):
        return self.model(input_ids, labels=labels)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self._saved_lr_total is not None:  # a resume's first batch: is the LR schedule the saved run's?
            saved, self._saved_lr_total = self._saved_lr_total, None
            if self.trainer.is_global_zero and (line := self.lr_schedule_change(saved, batch_idx)):
                say(line)
        if self.objective == "grpo":
            return self.grpo_step(batch, batch_idx)
        if self.objective == "agent":
            return self.agent_step(batch, batch_idx)
        if self.objective == "ppo":
            loss = ppo_step(self, batch, batch_idx)
            self.train_loss_mean.update(loss.float())
            return loss
        lr = self.lr_at(self.current_epoch, batch_idx + 1)
        for group in self.optimizers().param_groups:
            group["lr"] = lr
        if self.objective == "dpo":
            loss, stats = self.dpo_step(batch)
        elif self.objective == "distill":
            loss, stats = self.distill_step(batch)
        elif self.objective == "reward":
            loss, stats = bradley_terry_loss(self.model, batch)
        else:
            input_ids, labels = batch
            out = self.model(input_ids, labels=labels)
            loss = out.loss + out.aux_loss
            stats = {"loss": loss.detach(), "logits_loss": out.loss.detach(), "aux_loss": out.aux_loss.detach()}
        self.last_stats = {**stats, "lr": lr}
        self.train_loss_mean.update(loss.detach().float())
        # per-micro-batch metrics go to the loggers from lit_minimind.callbacks.MiniMindConsole, batched at its
        # log interval (Lightning's self.log would turn them into numbers, a host sync, every batch)
        return loss

    def dpo_step(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """MiniMind's DPO loss + the policy's MoE aux loss, and the detached statistics to log."""
        x, y, mask = dpo_inputs(batch)
        assert self.reference is not None, "DPO without a reference model (use_start_weights)"
        ref_log_probs = self.reference.log_probs(x, y, like=next(self.model.parameters()))
        out = self.model(x)
        dpo, rewards = dpo_loss(token_log_probs(out.logits, y), ref_log_probs, mask, self.beta)
        loss = dpo + out.aux_loss
        return loss, {"loss": loss.detach(), "dpo_loss": dpo.detach(), "aux_loss": out.aux_loss.detach(), **rewards}

    def distill_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """MiniMind's distillation loss against the frozen teacher, and the detached statistics to log."""
        input_ids, labels = batch
        assert self.teacher is not None, "distillation without a teacher (setup builds it)"
        teacher_logits = self.teacher.logits(input_ids, like=next(self.model.parameters()))
        out = self.model(input_ids)
        return distill_loss(out.logits, teacher_logits, labels, self.hparams.alpha, self.hparams.temperature, out.aux_loss)

    # ----------------------------------------------------------------- GRPO
    def setup_grpo(self) -> None:
        """GRPO's scorer (``--model.reward_model``, read once) and what the stage cannot do."""
        from lit_minimind.errors import UsageError

        datamodule = self.trainer.datamodule
        if getattr(datamodule, "val_fraction", 0):
            raise UsageError("GRPO has no validation loss: leave --data.val_fraction at 0")
        path = self.hparams.reward_model
        if self.scorer is None and path not in (None, "", "none"):
            self.scorer = load_scorer(path, datamodule.tokenizer, getattr(datamodule.train_dataset, "chat_template", None),
                                      self.hparams.reward_python)

    def teardown(self, stage: str) -> None:
        if hasattr(self.scorer, "close"):  # a transformers reward model's process
            self.scorer.close()

    def grpo_lr(self, optimizer_steps: int) -> float:
        """MiniMind's GRPO LR: ``CosineAnnealingLR`` over the run's optimizer steps down to a tenth of the peak
        (``T_max = ceil(iters / accumulation) * epochs``, or ``--trainer.max_steps``), after ``optimizer_steps``."""
        return annealed_lr(optimizer_steps, self.lr_total(), self.hparams.learning_rate)

    def prepare_rollout_stream(self, ids: torch.Tensor, batch_idx: int) -> bool:
        """At an epoch's first step in this process, seed torch's stream (agent RL: Python's ``random`` too) as
        MiniMind's epoch start (unless a resume restored them where they stood); returns whether it was seeded."""
        seeded = False
        if self._stream_epoch != self.current_epoch:
            if batch_idx == 0 or not self._rng_restored:
                seed_rollout_stream(self.current_epoch, len(self.trainer.datamodule.train_dataset), ids.device,
                                    self.global_rank)
                if self.objective == "agent":  # setup_seed's Python random too: agent RL's thinking draws
                    random.seed(MINIMIND_SEED + self.current_epoch + self.global_rank * RANK_SEED_STRIDE)
                seeded = True
            self._stream_epoch = self.current_epoch
        return seeded

    def grpo_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        """One rollout of the batch's prompts and MiniMind's GRPO / CISPO loss (:mod:`lit_minimind.model.grpo`)."""
        from lit_minimind.data.tokenizer import PAD_ID

        hp, generations = self.hparams, self.hparams.num_generations
        ids, prompts = batch["input_ids"], batch["prompts"]
        self.prepare_rollout_stream(ids, batch_idx)
        steps = self.trainer.global_step
        for group in self.optimizers().param_groups:
            group["lr"] = self.grpo_lr(steps)
        outputs = rollout(self.model, ids, batch["attention_mask"], generations, hp.max_gen_len)
        prompt_len = ids.shape[1]
        completion_ids = outputs[:, prompt_len:]
        completions = self.trainer.datamodule.tokenizer.decode_batch(completion_ids.tolist(), skip_special_tokens=True)
        rewards = rewards_of(prompts, completions, generations, self.scorer).to(ids.device)
        advantages = group_advantages(rewards, generations)
        attention = (outputs != PAD_ID).long()  # MiniMind's full_mask: a generated PAD is masked too
        out = self.model(outputs, attention_mask=attention)
        logps = completion_log_probs(out.logits, outputs, prompt_len)
        assert self.reference is not None, "GRPO without a reference model (setup builds it)"
        ref_logits = self.reference.logits(outputs, like=next(self.model.parameters()), attention_mask=attention)
        ref_logps = completion_log_probs(ref_logits, outputs, prompt_len)
        mask = completion_mask(completion_ids)
        pg_loss, kl_ref = policy_loss(logps, ref_logps, advantages, mask, hp.loss_type, self.beta, hp.epsilon,
                                      hp.epsilon_high)
        loss = pg_loss + out.aux_loss
        # MiniMind prints the LR after its scheduler stepped, which it does when step % accumulation == 0
        window_end = (batch_idx + 1) % self.trainer.accumulate_grad_batches == 0
        self.last_stats = {"loss": loss.detach(), "aux_loss": out.aux_loss.detach(), "reward": rewards.mean(),
                           "kl_ref": kl_ref, "advantages_std": advantages.std(), "advantages_mean": advantages.mean(),
                           "avg_response_len": mask.sum(dim=1).float().mean(),
                           "lr": self.grpo_lr(steps + 1 if window_end else steps)}
        self.rollout_log = {"completion_ids": completion_ids, "rewards": rewards}  # for callbacks and tests
        self.train_loss_mean.update(loss.detach().float())
        return loss

    def agent_step(self, batch: dict[str, list[Any]], batch_idx: int) -> torch.Tensor:
        """MiniMind's ``train_agent.py`` step (:mod:`lit_minimind.model.agent`): every sample's multi-turn rollouts
        (tools run, results appended; thinking drawn from Python's ``random``), their rewards, the packed
        trajectories' log-probs under the policy and the reference, and the GRPO / CISPO loss over the model's own
        tokens; the LR and the seeding as :meth:`grpo_step`'s."""
        from lit_minimind.data.tokenizer import PAD_ID
        from lit_minimind.model.agent import agent_loss, pack, rollout_batch, token_log_probs, trajectory_rewards

        hp, generations = self.hparams, self.hparams.num_generations
        device = next(self.model.parameters()).device
        self.prepare_rollout_stream(torch.empty(0, device=device), batch_idx)  # a tensor for its device
        steps = self.trainer.global_step
        for group in self.optimizers().param_groups:
            group["lr"] = self.grpo_lr(steps)
        datamodule = self.trainer.datamodule
        template = getattr(datamodule.train_dataset, "chat_template", None)
        trajectories = rollout_batch(self.model, datamodule.tokenizer, batch, generations, hp.max_gen_len,
                                     datamodule.thinking_ratio, random, template)
        rewards = trajectory_rewards(trajectories, batch, generations, self.scorer, template).to(device)
        input_ids, loss_mask, old_logps = pack(trajectories, hp.max_total_len, device)
        attention = (input_ids != PAD_ID).long()
        out = self.model(input_ids, attention_mask=attention)
        logps = token_log_probs(out.logits, input_ids)
        assert self.reference is not None, "agent RL without a reference model (setup builds it)"
        ref_logps = token_log_probs(self.reference.logits(input_ids, like=next(self.model.parameters()),
                                                          attention_mask=attention), input_ids)
        advantages = group_advantages(rewards, generations)
        pg_loss, kl_ref = agent_loss(logps, ref_logps, old_logps, advantages, loss_mask, hp.loss_type, self.beta,
                                     hp.epsilon, hp.epsilon_high)
        loss = pg_loss + out.aux_loss
        window_end = (batch_idx + 1) % self.trainer.accumulate_grad_batches == 0  # as grpo_step: the LR printed
        self.last_stats = {"loss": loss.detach(), "aux_loss": out.aux_loss.detach(), "reward": rewards.mean(),
                           "kl_ref": kl_ref, "group_reward_std": rewards.view(-1, generations).std(dim=1, unbiased=False).mean(),
                           "advantages_std": advantages.std(), "advantages_mean": advantages.mean(),
                           "avg_response_len": loss_mask.sum(dim=1).float().mean(),
                           "lr": self.grpo_lr(steps + 1 if window_end else steps)}
        self.rollout_log = {"completion_ids": input_ids, "rewards": rewards,  # the packed trajectories
                            "turn_outputs": [t.turn_outputs for t in trajectories]}
        self.train_loss_mean.update(loss.detach().float())
        return loss

    def on_train_epoch_end(self) -> None:
        if self.train_loss_mean.weight > 0:  # batches of this epoch trained (same count on every rank)
            self.log("mean_loss", self.train_loss_mean.compute(), prog_bar=True)  # one sync per epoch
        self.train_loss_mean.reset()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if self.objective == "dpo":  # val_loss: the DPO loss
            self.val_loss_mean.update(self.dpo_step(batch)[1]["dpo_loss"].float())
            return
        if self.objective == "reward":  # val_loss: the Bradley-Terry loss; val_reward_accuracy: pairs ranked right
            stats = bradley_terry_loss(self.model, batch)[1]
            self.val_loss_mean.update(stats["reward_loss"].float())
            self.val_accuracy_mean.update(stats["rewards/accuracy"], weight=batch["mask_chosen"].shape[0])
            return
        input_ids, labels = batch
        self.val_loss_mean.update(self.model(input_ids, labels=labels).loss.float())

    def on_validation_epoch_end(self) -> None:
        if self.val_loss_mean.weight > 0:
            val_loss = self.val_loss_mean.compute()
            self.log("val_loss", val_loss, prog_bar=True)
            if self.objective == "reward":
                self.log("val_reward_accuracy", self.val_accuracy_mean.compute(), prog_bar=True)
            else:
                self.log("val_perplexity", torch.exp(val_loss.clamp(max=50.0)))
        self.val_loss_mean.reset()
        self.val_accuracy_mean.reset()

    def configure_optimizers(self) -> torch.optim.Optimizer | list[torch.optim.Optimizer]:
        trainable = [p for p in self.model.parameters() if p.requires_grad]  # LoRA: the adapters only, as MiniMind
        if self.critic is not None:  # PPO: the actor's, then the critic's (MiniMind's critic_optimizer)
            return [torch.optim.AdamW(trainable, lr=self.hparams.learning_rate, weight_decay=self.hparams.weight_decay),
                    torch.optim.AdamW(self.critic.parameters(), lr=self.hparams.critic_learning_rate,
                                      weight_decay=self.hparams.weight_decay)]
        return torch.optim.AdamW(trainable, lr=self.hparams.learning_rate, weight_decay=self.hparams.weight_decay)

    # ----------------------------------------------------------------- checkpoints
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["model_config"] = self.config.to_dict()
        if math.isfinite(self.trainer.num_training_batches):  # a save during fit (not one before any epoch)
            checkpoint[LR_SCHEDULE_KEY] = {"total": self.lr_total()}
            if self.objective in ("grpo", "agent"):  # MiniMind's train_grpo.py / train_agent.py resume reads it
                save_minimind_scheduler(checkpoint, "scheduler", 0, self.trainer.global_step, self.lr_total(),
                                        self.hparams.learning_rate)
        if self.needs_start_weights and self.start_weights is not None:
            checkpoint[START_WEIGHTS_KEY] = dict(self.start_weights)
        if self.teacher is not None:
            checkpoint[TEACHER_KEY] = {"path": str(self.teacher.path), "sha256": self.teacher.sha256}
        if self.scorer is not None:
            checkpoint[REWARD_MODEL_KEY] = {"path": str(self.scorer.path), "sha256": self.scorer.sha256}
        if self.critic is not None:
            save_ppo_state(self, checkpoint)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Refuse a checkpoint of another model shape or start weights, naming every differing field at once
        (before anything is loaded; the DataModule checks its own state in its ``load_state_dict``)."""
        problems = config_mismatches(shape_config(checkpoint.get("state_dict", {})), shape_config(self.model.state_dict()))
        problems += self.start_weights_mismatches(checkpoint) + self.teacher_mismatches(checkpoint)
        problems += self.reward_model_mismatches(checkpoint)
        self._rng_restored = rank_rng_state(checkpoint.get(TRAINING_STATE_KEY) or {}, self.global_rank) is not None
        self._saved_lr_total = (checkpoint.get(LR_SCHEDULE_KEY) or {}).get("total")  # checked at the first batch
        if self.critic is not None:
            load_ppo_state(self, checkpoint)
        if problems:
            raise CheckpointError("checkpoint does not match this run (a resume needs the same model):\n  "
                                  + "\n  ".join(problems))
        state = checkpoint.get("state_dict")
        if state is not None:  # saved without the epoch's mean (MiniMind's files, older ones): it starts empty
            for key, value in self.train_loss_mean.state_dict(prefix="train_loss_mean.").items():
                state.setdefault(key, torch.zeros_like(value))

    def start_weights_mismatches(self, checkpoint: dict[str, Any]) -> list[str]:
        """What a LoRA/DPO resume lacks: the adapters (LoRA), or the start weights the run began from."""
        problems = []
        if self.hparams.lora_rank:
            own = [k for k in super().state_dict() if is_lora_key(k)]
            missing = [k for k in own if k not in checkpoint.get("state_dict", {})]
            if missing:
                problems.append(f"LoRA adapters: the checkpoint lacks {len(missing)} of {len(own)} ({missing[0]}, ...); "
                                "is it a LoRA run's checkpoint of this rank?")
        saved = checkpoint.get(START_WEIGHTS_KEY)
        if saved and self.needs_start_weights:
            what = "reference model" if self.objective in REFERENCE_OBJECTIVES else "LoRA base"
            if self.start_weights is None:
                problems.append(f"--from_weight: none given, but the checkpoint's {what} is {saved['path']} "
                                f"(sha256 {saved['sha256'][:12]}); pass it")
            elif self.start_weights["sha256"] != saved["sha256"]:
                problems.append(f"--from_weight {self.start_weights['path']} (the {what}) changed since the checkpoint was "
                                f"written: sha256 {self.start_weights['sha256'][:12]}, checkpoint {saved['sha256'][:12]} "
                                f"({saved['path']}); restore that file or start fresh")
        return problems

    def reward_model_mismatches(self, checkpoint: dict[str, Any]) -> list[str]:
        """A GRPO resume needs the reward model its checkpoint was trained with (or none, as then)."""
        saved = checkpoint.get(REWARD_MODEL_KEY)
        if self.objective not in ROLLOUT_OBJECTIVES or "state_dict" not in checkpoint or not checkpoint.get("hyper_parameters"):
            return []
        if saved is None and self.scorer is not None:
            return [f"--model.reward_model {self.scorer.path}: the checkpoint was trained with rule rewards only "
                    "(--model.reward_model none)"]
        if saved and self.scorer is None:
            return [f"--model.reward_model none, but the checkpoint was trained with {saved['path']} "
                    f"(sha256 {saved['sha256'][:12]}); pass it"]
        if saved and self.scorer is not None and self.scorer.sha256 != saved["sha256"]:
            return [f"--model.reward_model {self.scorer.path} changed since the checkpoint was written: sha256 "
                    f"{self.scorer.sha256[:12]}, checkpoint {saved['sha256'][:12]} ({saved['path']}); "
                    "restore that file or start fresh"]
        return []

    def teacher_mismatches(self, checkpoint: dict[str, Any]) -> list[str]:
        """A distillation resume needs the teacher file its checkpoint was trained against."""
        saved = checkpoint.get(TEACHER_KEY)
        if not saved or self.teacher is None:
            return []
        if self.teacher.sha256 != saved["sha256"]:
            return [f"--model.teacher {self.teacher.path} changed since the checkpoint was written: sha256 "
                    f"{self.teacher.sha256[:12]}, checkpoint {saved['sha256'][:12]} ({saved['path']}); "
                    "restore that file or start fresh"]
        return []
