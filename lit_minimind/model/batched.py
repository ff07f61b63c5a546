"""One forward per token for many sequences at once, each getting exactly the tokens it gets alone.

The server's continuous batching (``lit_minimind.cli.serve_engine``) decodes every active request with one
:func:`decode_step`; a request joins after its own :func:`prefill` and leaves between two steps.

**The layout: a KV cache per sequence, the row-wise layers batched.** Every layer but attention works on each
position's row alone (embedding, RMSNorm, the projections, SwiGLU, the LM head), so they run on the ``(B, 1,
hidden)`` rows of all sequences together; attention runs per sequence over its own cache, each with the very ops
:func:`~lit_minimind.model.minimind.sample_tokens` runs at batch 1. A padded cache (one ``(B, T_max)`` tensor
with a mask) would batch attention too, but its masked positions enter each softmax's sum and its matmuls'
blocking, so a request's logits, and so its sampled tokens, would depend on who it is batched with; a paged
cache needs kernels this CPU-only package does not have. Per-sequence caches also make joining and leaving free
(nothing to pad, shift or compact) and cost no memory for a short request next to a long one.

**Bit-exactness.** A matrix product of ``B`` rows is not the ``B`` products of one row: MKL multiplies one row
with a matrix-vector kernel and several with a blocked GEMM, which sums in another order (the last bits differ,
and a seeded draw near a boundary with them). :func:`rows_linear` therefore multiplies the rows with one
``torch.bmm`` of ``B`` one-row products, the matrix-vector kernel a lone row gets; :func:`exact_rows` checks that
on this machine at start (a build whose ``bmm`` sums otherwise falls back to one ``F.linear`` per row, slower but
exact by construction). MoE layers route per row and run per sequence. ``tests/test_serve_load.py`` checks that
batched tokens equal :func:`~lit_minimind.model.minimind.sample_tokens`'s, greedy and seeded.
"""

from __future__ import annotations

import math
from typing import Callable, List, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from lit_minimind.model.minimind import KVCache, MiniMindForCausalLM, MoEFeedForward, _rotate_half, repeat_kv

__all__ = ["Cache", "prefill", "decode_step", "rows_linear", "exact_rows"]

Cache = List[KVCache]
"""One sequence's cache: per layer ``(k, v)``, each ``(1, length, n_heads, head_dim)`` after RoPE, contiguous: the
model's cache with its key/value heads already repeated for grouped-query attention (``repeat_kv``), so a step
repeats only the new position's, for all sequences at once, instead of each sequence's whole cache; the tensors
attention multiplies have the very values and strides of the batch-1 forward's."""

RowsLinear = Callable[[nn.Linear, torch.Tensor], torch.Tensor]


def rows_linear(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``linear`` on each row of ``x`` ``(B, K)`` as on that row alone: ``(B, N)`` from ``B`` one-row products."""
    weight = linear.weight.t()
    out = torch.bmm(x.unsqueeze(1), weight.unsqueeze(0).expand(x.shape[0], *weight.shape)).squeeze(1)
    return out if linear.bias is None else out + linear.bias


def _each_linear(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The fallback: one ``F.linear`` per row, shaped as the batch-1 forward shapes it ``(1, 1, K)``."""
    return torch.cat([linear(row.view(1, 1, -1)).view(1, -1) for row in x])


def exact_rows(model: MiniMindForCausalLM, batch: int = 16) -> RowsLinear:
    """:func:`rows_linear` if, on this machine, it gives every layer's rows exactly as a lone row's forward does (on
    random rows, at a few batch sizes), else the per-row fallback."""
    generator = torch.Generator().manual_seed(0)
    linears = {m.weight.shape: m for m in model.modules() if isinstance(m, nn.Linear)}.values()
    with torch.inference_mode():
        for linear in linears:
            for b in sorted({1, 2, 3, batch, batch + 1}):
                x = torch.randn(b, linear.in_features, generator=generator, dtype=linear.weight.dtype)
                alone = torch.cat([linear(row.view(1, 1, -1)).view(1, -1) for row in x])
                if not torch.equal(rows_linear(linear, x), alone):
                    return _each_linear
    return rows_linear


@torch.inference_mode()
def prefill(model: MiniMindForCausalLM, ids: Sequence[int]) -> Tuple[Cache, torch.Tensor]:
    """A prompt's cache (:data:`Cache`) and the logits ``(1, vocab)`` of its next token: the first forward of
    ``sample_tokens``."""
    out = model(torch.tensor([list(ids)]), use_cache=True, logits_to_keep=1)
    n_rep = model.model.layers[0].self_attn.n_rep
    cache = [(repeat_kv(k, n_rep).contiguous(), repeat_kv(v, n_rep).contiguous()) for k, v in out.past_key_values]
    return cache, out.logits[:, -1, :].float()


def _attend(scale: float, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: KVCache) -> Tuple[torch.Tensor, KVCache]:
    """One sequence's new position ``q``/``k``/``v`` ``(1, 1, heads, head_dim)`` (``k``, ``v`` repeated) against its
    cache: the ops of ``Attention.forward`` with a cache and one query (its causal mask adds 0 to the one new column:
    left out)."""
    k = torch.cat([past[0], k], dim=1)
    v = torch.cat([past[1], v], dim=1)
    scores = (q.transpose(1, 2) @ k.permute(0, 2, 3, 1)) / scale
    probs = F.softmax(scores, dim=-1)  # float32 already: .float() and .type_as() are no-ops there
    return (probs @ v.transpose(1, 2)).transpose(1, 2).reshape(1, 1, -1), (k, v)


@torch.inference_mode()
def decode_step(model: MiniMindForCausalLM, caches: List[Cache], tokens: Sequence[int],
                linear: RowsLinear = rows_linear) -> torch.Tensor:
    """Feed each sequence its next token ``tokens[i]``: its cache ``caches[i]`` grows by one position (in place)
    and the logits ``(B, vocab)`` of every sequence's next token come back, each row what a batch-1 forward gives."""
    core, b = model.model, len(tokens)
    if model.training or model.lm_head.weight.dtype != torch.float32:
        raise ValueError("decode_step runs a float32 model in eval mode (as the server does)")
    positions = torch.tensor([cache[0][0].shape[1] for cache in caches])
    if int(positions.max()) + 1 > core.freqs_cos.shape[0]:
        raise ValueError(f"Sequence length {int(positions.max()) + 1} exceeds max_position_embeddings "
                         f"({core.freqs_cos.shape[0]})")
    cos = core.freqs_cos[positions].view(b, 1, 1, -1)
    sin = core.freqs_sin[positions].view(b, 1, 1, -1)
    x = core.embed_tokens(torch.tensor(list(tokens))).view(b, -1)  # (B, hidden)
    for index, layer in enumerate(core.layers):
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q = linear(attn.q_proj, h).view(b, 1, attn.n_heads, attn.head_dim)
        k = linear(attn.k_proj, h).view(b, 1, attn.n_kv_heads, attn.head_dim)
        v = linear(attn.v_proj, h).view(b, 1, attn.n_kv_heads, attn.head_dim)
        q, k = attn.q_norm(q), attn.k_norm(k)
        q = (q * cos + _rotate_half(q) * sin).to(q.dtype)  # apply_rotary_pos_emb, each row at its own position
        k = (k * cos + _rotate_half(k) * sin).to(k.dtype)
        k, v, scale = repeat_kv(k, attn.n_rep), repeat_kv(v, attn.n_rep), math.sqrt(attn.head_dim)
        outs = []
        for i, (qi, ki, vi) in enumerate(zip(q.split(1), k.split(1), v.split(1))):
            out, caches[i][index] = _attend(scale, qi, ki, vi, caches[i][index])
            outs.append(out)
        x = x + linear(attn.o_proj, torch.cat(outs).view(b, -1))
        h = layer.post_attention_layernorm(x)
        mlp = layer.mlp
        if isinstance(mlp, MoEFeedForward):  # routing per row: each sequence alone
            x = x + torch.cat([mlp(h[i:i + 1].view(1, 1, -1))[0].view(1, -1) for i in range(b)])
        else:
            x = x + linear(mlp.down_proj, mlp.act_fn(linear(mlp.gate_proj, h)) * linear(mlp.up_proj, h))
    return linear(model.lm_head, core.norm(x)).float()


def decode_alone(model: MiniMindForCausalLM, cache: List[KVCache], token: int) -> torch.Tensor:
    """The batch-1 forward :func:`decode_step` must match (for tests): ``sample_tokens``'s call with the model's own
    cache (``model(ids, use_cache=True).past_key_values``), which grows in place."""
    with torch.inference_mode():
        out = model(torch.tensor([[token]]), past_key_values=cache, use_cache=True, logits_to_keep=1)
    cache[:] = out.past_key_values
    return out.logits[:, -1, :].float()

