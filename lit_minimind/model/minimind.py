"""MiniMind decoder-only transformer in plain PyTorch.

A dependency-free reimplementation of ``model/model_minimind.py`` from
https://github.com/jingyaogong/minimind. The math (RMSNorm, RoPE incl. optional
YaRN, GQA attention with per-head q/k norm, SwiGLU MLP, top-k MoE with the
router auxiliary loss) and the parameter names match the original, so the
original checkpoints load with ``load_state_dict(..., strict=True)``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = [
    "MiniMindConfig",
    "CausalLMOutput",
    "RMSNorm",
    "Attention",
    "FeedForward",
    "MoEFeedForward",
    "MiniMindBlock",
    "MiniMindModel",
    "MiniMindForCausalLM",
    "precompute_rope",
    "apply_rotary_pos_emb",
    "repeat_kv",
    "SkipWeightInit",
]

KVCache = Tuple[torch.Tensor, torch.Tensor]
"""Per-layer cache: ``(k, v)``, each ``(batch, seq, n_kv_heads, head_dim)`` after RoPE."""


# --------------------------------------------------------------------------- config


@dataclass
class MiniMindConfig:
    """Hyper-parameters of a MiniMind model (same names/defaults as the original)."""

    hidden_size: int = 768
    num_hidden_layers: int = 8
    use_moe: bool = False
    dropout: float = 0.0
    vocab_size: int = 6400
    bos_token_id: int = 1
    eos_token_id: int = 2
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: Optional[int] = None  # -> hidden_size // num_attention_heads
    hidden_act: str = "silu"
    intermediate_size: Optional[int] = None  # -> ceil(hidden_size * pi / 64) * 64
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    tie_word_embeddings: bool = True
    flash_attn: bool = True
    inference_rope_scaling: bool = False  # YaRN context extension (inference only)
    # MoE (ignored unless use_moe)
    num_experts: int = 4
    num_experts_per_tok: int = 1
    moe_intermediate_size: Optional[int] = None  # -> intermediate_size
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 5e-4

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.intermediate_size is None:
            self.intermediate_size = math.ceil(self.hidden_size * math.pi / 64) * 64
        if self.moe_intermediate_size is None:
            self.moe_intermediate_size = self.intermediate_size
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be divisible by "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    @property
    def rope_scaling(self) -> Optional[Dict[str, Any]]:
        """YaRN parameters used by MiniMind when ``inference_rope_scaling`` is on."""
        if not self.inference_rope_scaling:
            return None
        return {
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 16,
            "original_max_position_embeddings": 2048,
            "attention_factor": 1.0,
            "type": "yarn",
        }

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "MiniMindConfig":
        """Build a config from a dict, silently ignoring unknown keys."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass
class CausalLMOutput:
    logits: torch.Tensor
    loss: Optional[torch.Tensor] = None
    aux_loss: Optional[torch.Tensor] = None
    past_key_values: Optional[List[Optional[KVCache]]] = None


# --------------------------------------------------------------------------- building blocks

_ACTIVATIONS: Dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    try:
        return _ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"Unsupported hidden_act {name!r}; choose from {sorted(_ACTIVATIONS)}") from None


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, computed in float32."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * xf).type_as(x)


def precompute_rope(
    dim: int,
    end: int = 32 * 1024,
    theta: float = 1e6,
    rope_scaling: Optional[Dict[str, Any]] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Return ``(cos, sin)`` tables of shape ``(end, dim)`` (half-rotation layout)."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    attn_factor = 1.0
    if rope_scaling is not None:  # YaRN: f'(i) = f(i) * ((1 - ramp) + ramp / factor)
        orig_max = rope_scaling.get("original_max_position_embeddings", 2048)
        factor = rope_scaling.get("factor", 16)
        beta_fast = rope_scaling.get("beta_fast", 32.0)
        beta_slow = rope_scaling.get("beta_slow", 1.0)
        attn_factor = rope_scaling.get("attention_factor", 1.0)
        if end / orig_max > 1.0:

            def inv_dim(beta: float) -> float:
                return (dim * math.log(orig_max / (beta * 2 * math.pi))) / (2 * math.log(theta))

            low = max(math.floor(inv_dim(beta_fast)), 0)
            high = min(math.ceil(inv_dim(beta_slow)), dim // 2 - 1)
            ramp = torch.clamp((torch.arange(dim // 2).float() - low) / max(high - low, 0.001), 0, 1)
            freqs = freqs * (1 - ramp + ramp / factor)
    angles = torch.outer(torch.arange(end), freqs).float()
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1) * attn_factor
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1) * attn_factor
    return cos, sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary_pos_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q``/``k`` of shape ``(B, T, H, D)`` with ``cos``/``sin`` of shape ``(T, D)``."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    q_rot = (q * cos + _rotate_half(q) * sin).to(q.dtype)
    k_rot = (k * cos + _rotate_half(k) * sin).to(k.dtype)
    return q_rot, k_rot


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Expand ``(B, T, n_kv, D)`` to ``(B, T, n_kv * n_rep, D)`` for grouped-query attention."""
    if n_rep == 1:
        return x
    b, t, n_kv, d = x.shape
    return x[:, :, :, None, :].expand(b, t, n_kv, n_rep, d).reshape(b, t, n_kv * n_rep, d)


class Attention(nn.Module):
    """Causal grouped-query self-attention with per-head RMSNorm on q and k."""

    def __init__(self, config: MiniMindConfig) -> None:
        super().__init__()
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.n_rep = self.n_heads // self.n_kv_heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.dropout = config.dropout
        self.flash = config.flash_attn

    def forward(
        self,
        x: torch.Tensor,
        position_embeddings: Tuple[torch.Tensor, torch.Tensor],
        past_key_value: Optional[KVCache] = None,
        use_cache: bool = False,
        attention_mask: Optional[torch.Tensor] = None,
    ) -> Tuple[torch.Tensor, Optional[KVCache]]:
        bsz, seq_len, _ = x.shape
        q = self.q_proj(x).view(bsz, seq_len, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(bsz, seq_len, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(bsz, seq_len, self.n_kv_heads, self.head_dim)
        q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary_pos_emb(q, k, *position_embeddings)

        if past_key_value is not None:
            k = torch.cat([past_key_value[0], k], dim=1)
            v = torch.cat([past_key_value[1], v], dim=1)
        present = (k, v) if use_cache else None

        # (B, H, T, D)
        q = q.transpose(1, 2)
        k = repeat_kv(k, self.n_rep).transpose(1, 2)
        v = repeat_kv(v, self.n_rep).transpose(1, 2)

        use_sdpa = (
            self.flash
            and seq_len > 1
            and past_key_value is None
            and (attention_mask is None or bool(torch.all(attention_mask == 1)))
        )
        if use_sdpa:
            out = F.scaled_dot_product_attention(
                q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
            )
        else:
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
            causal = torch.full((seq_len, seq_len), float("-inf"), device=scores.device).triu(1)
            scores[:, :, :, -seq_len:] += causal  # new queries only see past + themselves
            if attention_mask is not None:  # (B, T_total), 1 = keep, 0 = pad
                scores += (1.0 - attention_mask[:, None, None, :]) * -1e9
            probs = F.softmax(scores.float(), dim=-1).type_as(q)
            out = self.attn_dropout(probs) @ v

        out = out.transpose(1, 2).reshape(bsz, seq_len, -1)
        return self.resid_dropout(self.o_proj(out)), present


class FeedForward(nn.Module):
    """Gated MLP: ``down(act(gate(x)) * up(x))``."""

    def __init__(self, config: MiniMindConfig, intermediate_size: Optional[int] = None) -> None:
        super().__init__()
        intermediate_size = intermediate_size or config.intermediate_size
        self.gate_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, config.hidden_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.act_fn = get_activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class MoEFeedForward(nn.Module):
    """Top-k routed mixture of gated-MLP experts with MiniMind's load-balancing loss."""

    def __init__(self, config: MiniMindConfig) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.aux_loss_coef = config.router_aux_loss_coef
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList(
            FeedForward(config, intermediate_size=config.moe_intermediate_size)
            for _ in range(config.num_experts)
        )

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Return ``(output, aux_loss)``; ``aux_loss`` is a 0-dim tensor (zero in eval)."""
        bsz, seq_len, hidden = x.shape
        x_flat = x.view(-1, hidden)
        scores = F.softmax(self.gate(x_flat), dim=-1)  # (N, E)
        topk_weight, topk_idx = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
        if self.norm_topk_prob:
            topk_weight = topk_weight / (topk_weight.sum(dim=-1, keepdim=True) + 1e-20)

        # Tokens grouped by expert with one stable sort: each expert sees its tokens in ascending order,
        # exactly as MiniMind's per-expert mask selects them (so the output is bit-identical), and the
        # host learns the group sizes with one transfer per layer instead of three per expert.
        flat_idx = topk_idx.reshape(-1)
        order = torch.argsort(flat_idx, stable=True)
        counts = torch.bincount(flat_idx, minlength=self.num_experts).tolist()
        tokens, weights = order // self.top_k, topk_weight.reshape(-1)[order]
        y = torch.zeros_like(x_flat)
        start = 0
        for expert, count in zip(self.experts, counts):
            if count:
                token_idx = tokens[start:start + count]
                weight = weights[start:start + count].view(-1, 1)
                y.index_add_(0, token_idx, (expert(x_flat[token_idx]) * weight).to(y.dtype))
            elif self.training:
                # Touch unused experts so DDP sees a gradient for every parameter.
                y[0, 0] += 0 * sum(p.sum() for p in expert.parameters())
            start += count

        if self.training and self.aux_loss_coef > 0:
            load = F.one_hot(topk_idx, self.num_experts).float().mean(0)  # (k, E)
            aux_loss = (load * scores.mean(0)).sum() * self.num_experts * self.aux_loss_coef
        else:
            aux_loss = scores.new_zeros(())
        return y.view(bsz, seq_len, hidden), aux_loss


class MiniMindBlock(nn.Module):
    """Pre-norm transformer block: attention + (dense or MoE) MLP."""

    def __init__(self, layer_id: int, config: MiniMindConfig) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.self_attn = Attention(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = MoEFeedForward(config) if config.use_moe else FeedForward(config)

    def forward(
        self,
        x: torch.Tensor,
        position_embeddings: Tuple[torch.Tensor, torch.Tensor],
        past_key_value: Optional[KVCache] = None,
        use_cache: bool = False,
        attention_mask: Optional[torch.Tensor] = None,
    ) -> Tuple[torch.Tensor, Optional[KVCache], Optional[torch.Tensor]]:
        """Return ``(hidden, present_kv, aux_loss)``; ``aux_loss`` is None for dense MLPs."""
        attn_out, present = self.self_attn(
            self.input_layernorm(x), position_embeddings, past_key_value, use_cache, attention_mask
        )
        x = x + attn_out
        aux_loss = None
        if isinstance(self.mlp, MoEFeedForward):
            mlp_out, aux_loss = self.mlp(self.post_attention_layernorm(x))
        else:
            mlp_out = self.mlp(self.post_attention_layernorm(x))
        return x + mlp_out, present, aux_loss


# --------------------------------------------------------------------------- models


class MiniMindModel(nn.Module):
    """Embedding + stack of blocks + final norm (no LM head)."""

    def __init__(self, config: MiniMindConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.dropout = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(MiniMindBlock(i, config) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        cos, sin = self._rope_tables()
        self.register_buffer("freqs_cos", cos, persistent=False)
        self.register_buffer("freqs_sin", sin, persistent=False)

    def _rope_tables(self) -> Tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        return precompute_rope(c.head_dim, c.max_position_embeddings, c.rope_theta, c.rope_scaling)

    def reset_rope_cache(self) -> None:
        """Recompute the RoPE buffers (e.g. after materialising a meta-device model)."""
        cos, sin = self._rope_tables()
        device = self.embed_tokens.weight.device
        self.freqs_cos, self.freqs_sin = cos.to(device), sin.to(device)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        past_key_values: Optional[List[Optional[KVCache]]] = None,
        use_cache: bool = False,
    ) -> Tuple[torch.Tensor, List[Optional[KVCache]], torch.Tensor]:
        """Return ``(hidden_states, presents, aux_loss)``."""
        seq_len = input_ids.shape[1]
        if past_key_values is None:
            past_key_values = [None] * len(self.layers)
        start = past_key_values[0][0].shape[1] if past_key_values[0] is not None else 0
        if start + seq_len > self.freqs_cos.shape[0]:
            raise ValueError(
                f"Sequence length {start + seq_len} exceeds max_position_embeddings "
                f"({self.freqs_cos.shape[0]})"
            )

        x = self.dropout(self.embed_tokens(input_ids))
        rope = (self.freqs_cos[start : start + seq_len], self.freqs_sin[start : start + seq_len])
        presents: List[Optional[KVCache]] = []
        aux_loss = x.new_zeros(())
        for layer, past in zip(self.layers, past_key_values):
            x, present, layer_aux = layer(x, rope, past, use_cache, attention_mask)
            presents.append(present)
            if layer_aux is not None:
                aux_loss = aux_loss + layer_aux
        return self.norm(x), presents, aux_loss


def pick_next_token(logits: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                    generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """The next token ``(B, 1)`` from the last position's ``logits`` ``(B, V)``: the argmax at ``temperature``
    0, else a draw from ``generator`` after top-k and nucleus (top-p) filtering."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.size(-1)))[0][..., -1, None]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(logits, descending=True)
        remove = torch.cumsum(F.softmax(sorted_logits, dim=-1), dim=-1) > top_p
        remove[..., 1:] = remove[..., :-1].clone()  # always keep the top token
        remove[..., 0] = False
        logits = logits.masked_fill(remove.scatter(1, sorted_idx, remove), float("-inf"))
    return torch.multinomial(F.softmax(logits, dim=-1), num_samples=1, generator=generator)


def sample_tokens(model: MiniMindForCausalLM, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                  top_p: float = 1.0, top_k: int = 0, eos_token_id: int | None = 2,
                  generator: torch.Generator | None = None) -> Iterator[int]:
    """The tokens ``model.generate(input_ids, ...)`` would produce, one at a time, as it produces them.

    The same forward calls (KV cache, ``logits_to_keep=1``), the same sampling and the same draws from
    ``generator``, so the tokens are ``generate``'s (a test checks it); ends at ``eos_token_id``, which is not
    yielded, or after ``max_new_tokens``. The caller may stop iterating at any token.
    """
    past = None
    ids = input_ids
    for _ in range(max_new_tokens):
        with torch.inference_mode():
            past_len = past[0][0].shape[1] if past is not None else 0
            out = model(ids[:, past_len:], past_key_values=past, use_cache=True, logits_to_keep=1)
            past = out.past_key_values
            next_token = pick_next_token(out.logits[:, -1, :].float(), temperature, top_p, top_k, generator)
            token = int(next_token)
            if token == eos_token_id:
                return
            ids = torch.cat([ids, next_token.to(ids.dtype)], dim=-1)
        yield token


class SkipWeightInit(TorchFunctionMode):
    """Inside it, ``torch.nn.init``'s functions leave their tensor as it is (``torch.empty``'s memory) and draw no
    random number: for a model whose every weight a checkpoint is about to overwrite. Buffers and
    parameters set without ``torch.nn.init`` (RoPE tables, metric states) are built as usual.

    Written here because Lightning's equivalent is private (``Trainer.init_module(empty_init=True)`` needs a
    Trainer, which LightningCLI builds after the model)."""

    def __torch_function__(self, func: Callable, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            return kwargs["tensor"] if "tensor" in kwargs else args[0]
        return func(*args, **kwargs)


class MiniMindForCausalLM(nn.Module):
    """MiniMind language model: :class:`MiniMindModel` plus a (tied) LM head."""

    def __init__(self, config: Optional[MiniMindConfig] = None) -> None:
        super().__init__()
        self.config = config or MiniMindConfig()
        self.model = MiniMindModel(self.config)
        self.lm_head = nn.Linear(self.config.hidden_size, self.config.vocab_size, bias=False)
        if self.config.tie_word_embeddings:
            self.model.embed_tokens.weight = self.lm_head.weight
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module, std: float = 0.02) -> None:
        """HF-style init: N(0, 0.02) for Linear/Embedding weights, zero bias, ones for RMSNorm."""
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.padding_idx is not None:
                with torch.no_grad():
                    module.weight[module.padding_idx].zero_()
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)

    def num_parameters(self, trainable_only: bool = False) -> int:
        """Number of (unique) parameters; tied embeddings are counted once."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        past_key_values: Optional[List[Optional[KVCache]]] = None,
        use_cache: bool = False,
        logits_to_keep: Union[int, torch.Tensor] = 0,
    ) -> CausalLMOutput:
        """Run the model.

        Args:
            input_ids: ``(B, T)`` token ids.
            labels: ``(B, T)`` targets aligned with ``input_ids`` (shifted internally);
                ``-100`` is ignored.
            attention_mask: ``(B, T_past + T)`` with 1 for real tokens, 0 for padding.
            past_key_values: per-layer ``(k, v)`` cache from a previous call.
            use_cache: return the updated cache in ``past_key_values``.
            logits_to_keep: if an int ``n > 0``, only compute logits for the last ``n``
                positions (0 keeps all); a tensor selects positions explicitly.
        """
        hidden, presents, aux_loss = self.model(input_ids, attention_mask, past_key_values, use_cache)
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden[:, keep, :])

        loss = None
        if labels is not None:
            shift_logits = logits[..., :-1, :].contiguous()
            shift_labels = labels[..., 1:].contiguous()
            loss = F.cross_entropy(
                shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1), ignore_index=-100
            )
        return CausalLMOutput(
            logits=logits,
            loss=loss,
            aux_loss=aux_loss,
            past_key_values=presents if use_cache else None,
        )

    @torch.inference_mode()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int = 64,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        greedy: bool = False,
        eos_token_id: Optional[int] = 2,
        use_cache: bool = True,
        generator: Optional[torch.Generator] = None,
        attention_mask: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Autoregressively extend ``input_ids`` ``(B, T)``; returns ``(B, T + n_new)``.

        Greedy decoding when ``greedy`` or ``temperature == 0``, otherwise sampling with
        optional top-k / nucleus (top-p) filtering. Sequences that emitted ``eos_token_id``
        are padded with it; decoding stops early once every sequence has finished.
        ``attention_mask`` ``(B, T)`` (0 on left padding) is extended by one column of ones per
        new token, as MiniMind's ``generate``.
        """
        greedy = greedy or temperature == 0
        finished = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        past: Optional[List[Optional[KVCache]]] = None
        for _ in range(max_new_tokens):
            past_len = past[0][0].shape[1] if past is not None else 0
            out = self.forward(input_ids[:, past_len:], attention_mask=attention_mask, past_key_values=past,
                               use_cache=use_cache, logits_to_keep=1)
            past = out.past_key_values if use_cache else None
            logits = out.logits[:, -1, :].float()
            if attention_mask is not None:
                attention_mask = torch.cat([attention_mask, attention_mask.new_ones(attention_mask.shape[0], 1)], -1)

            next_token = pick_next_token(logits, 0.0 if greedy else temperature, top_p, top_k, generator)
            if eos_token_id is not None:
                next_token = next_token.masked_fill(finished[:, None], eos_token_id)
            input_ids = torch.cat([input_ids, next_token.to(input_ids.dtype)], dim=-1)
            if eos_token_id is not None:
                finished |= next_token.squeeze(-1) == eos_token_id
                if bool(finished.all()):
                    break
        return input_ids
