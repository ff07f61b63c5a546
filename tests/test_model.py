"""Tests for lit_minimind.model: parity with the original MiniMind + basic behaviour."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # allow running plain `pytest` without an installed package
    sys.path.insert(0, str(ROOT))

from lit_minimind.model import CausalLMOutput, MiniMindConfig, MiniMindForCausalLM  # noqa: E402

PARITY_DIR = ROOT.parent / "shared" / "minimind" / "parity"
ATOL = 1e-5

needs_parity = pytest.mark.skipif(
    not PARITY_DIR.is_dir(), reason=f"MiniMind parity fixtures not found at {PARITY_DIR}"
)


def tiny_config(**overrides) -> MiniMindConfig:
    kw = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
              intermediate_size=128, max_position_embeddings=256)
    kw.update(overrides)
    return MiniMindConfig(**kw)


def load_parity_model(kind: str) -> MiniMindForCausalLM:
    cfg = MiniMindConfig.from_dict(json.loads((PARITY_DIR / f"{kind}_config.json").read_text()))
    model = MiniMindForCausalLM(cfg)
    state = torch.load(PARITY_DIR / f"{kind}_weights.pth", map_location="cpu")
    model.load_state_dict(state, strict=True)
    return model


def parse_keys_listing(path: Path) -> list[tuple[str, tuple[int, ...], str]]:
    rows = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        name, shape, dtype = line.split("\t")
        rows.append((name, tuple(int(s) for s in shape.strip("()").split(",") if s.strip()), dtype))
    return rows


# --------------------------------------------------------------------------- parity


@needs_parity
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_parity_with_original(kind: str) -> None:
    model = load_parity_model(kind)
    expected = torch.load(PARITY_DIR / f"{kind}_expected.pth", map_location="cpu")
    input_ids, labels = expected["input_ids"], expected["labels"]

    for mode in ("train", "eval"):
        model.train(mode == "train")
        with torch.no_grad():
            out = model(input_ids, labels=labels)
        assert isinstance(out, CausalLMOutput)
        torch.testing.assert_close(out.logits, expected[f"{mode}_logits"], atol=ATOL, rtol=0)
        torch.testing.assert_close(out.loss, expected[f"{mode}_loss"], atol=ATOL, rtol=0)
        torch.testing.assert_close(out.aux_loss, expected[f"{mode}_aux_loss"], atol=ATOL, rtol=0)


@needs_parity
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_state_dict_matches_listing(kind: str) -> None:
    model = load_parity_model(kind)
    listing = parse_keys_listing(PARITY_DIR / f"{kind}_state_dict_keys.txt")
    actual = [(k, tuple(v.shape), str(v.dtype)) for k, v in model.state_dict().items()]
    assert actual == listing
    # RoPE tables are non-persistent buffers; embeddings are tied.
    assert not any("freqs" in k for k in model.state_dict())
    assert model.lm_head.weight is model.model.embed_tokens.weight


# --------------------------------------------------------------------------- config


def test_config_defaults() -> None:
    cfg = MiniMindConfig()
    assert cfg.hidden_size == 768 and cfg.num_hidden_layers == 8
    assert cfg.head_dim == 96
    assert cfg.intermediate_size == 2432
    assert cfg.moe_intermediate_size == 2432
    assert cfg.vocab_size == 6400 and cfg.bos_token_id == 1 and cfg.eos_token_id == 2
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (8, 4)
    assert cfg.rope_theta == 1e6 and cfg.rms_norm_eps == 1e-6 and cfg.max_position_embeddings == 32768
    assert cfg.tie_word_embeddings and cfg.flash_attn and not cfg.use_moe
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob) == (4, 1, True)
    assert cfg.router_aux_loss_coef == 5e-4 and cfg.dropout == 0.0 and cfg.hidden_act == "silu"
    assert cfg.rope_scaling is None


def test_config_dict_roundtrip_ignores_unknown_keys() -> None:
    cfg = MiniMindConfig(hidden_size=512, use_moe=True)
    d = cfg.to_dict()
    assert d["intermediate_size"] == 1664 and d["head_dim"] == 64
    restored = MiniMindConfig.from_dict({**d, "model_type": "minimind", "transformers_version": "x"})
    assert restored == cfg


# --------------------------------------------------------------------------- model behaviour


def test_init_is_deterministic_and_hf_like() -> None:
    torch.manual_seed(0)
    a = MiniMindForCausalLM(tiny_config(use_moe=True))
    torch.manual_seed(0)
    b = MiniMindForCausalLM(tiny_config(use_moe=True))
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb
        assert torch.equal(va, vb), ka
    w = a.model.layers[0].self_attn.q_proj.weight
    assert abs(w.std().item() - 0.02) < 0.005
    assert torch.all(a.model.layers[0].input_layernorm.weight == 1)
    assert a.num_parameters() == sum(p.numel() for p in a.parameters())


def test_loss_and_logits_to_keep() -> None:
    torch.manual_seed(0)
    model = MiniMindForCausalLM(tiny_config()).eval()
    ids = torch.randint(0, 6400, (2, 10))
    labels = ids.clone()
    labels[:, -3:] = -100
    out = model(ids, labels=labels)
    ref = torch.nn.functional.cross_entropy(
        out.logits[:, :-1].reshape(-1, 6400), labels[:, 1:].reshape(-1), ignore_index=-100
    )
    torch.testing.assert_close(out.loss, ref)
    assert model(ids).loss is None
    last = model(ids, logits_to_keep=1).logits
    assert last.shape == (2, 1, 6400)
    torch.testing.assert_close(last, out.logits[:, -1:], atol=1e-6, rtol=0)


def test_aux_loss() -> None:
    torch.manual_seed(0)
    ids = torch.randint(0, 6400, (2, 12))
    dense = MiniMindForCausalLM(tiny_config())
    moe = MiniMindForCausalLM(tiny_config(use_moe=True))
    for model in (dense, moe):
        model.eval()
        aux = model(ids).aux_loss
        assert aux.dim() == 0 and aux.item() == 0.0
    dense.train()
    assert dense(ids).aux_loss.item() == 0.0
    moe.train()
    aux = moe(ids).aux_loss
    assert aux.dim() == 0 and aux.item() > 0


def test_moe_all_experts_receive_grad_in_train() -> None:
    """Unused experts get a (zero) gradient thanks to the 0 * sum(p) trick (for DDP)."""
    torch.manual_seed(0)
    model = MiniMindForCausalLM(tiny_config(use_moe=True, num_experts=8)).train()
    ids = torch.randint(0, 6400, (1, 2))  # 2 tokens -> most of the 8 experts unused
    out = model(ids, labels=ids)
    (out.loss + out.aux_loss).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_kv_cache_matches_full_forward() -> None:
    torch.manual_seed(0)
    model = MiniMindForCausalLM(tiny_config()).eval()
    ids = torch.randint(0, 6400, (2, 9))
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :6], use_cache=True)
        assert len(out.past_key_values) == 2
        k, v = out.past_key_values[0]
        assert k.shape == v.shape == (2, 6, 4, 8)
        logits = [out.logits]
        past = out.past_key_values
        for t in range(6, 9):
            step = model(ids[:, t : t + 1], past_key_values=past, use_cache=True)
            past = step.past_key_values
            logits.append(step.logits)
    torch.testing.assert_close(torch.cat(logits, dim=1), full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("use_moe", [False, True])
def test_greedy_generate_cache_equals_no_cache(use_moe: bool) -> None:
    torch.manual_seed(0)
    model = MiniMindForCausalLM(tiny_config(use_moe=use_moe)).eval()
    prompt = torch.randint(3, 6400, (2, 5))
    cached = model.generate(prompt, max_new_tokens=8, greedy=True, eos_token_id=None)
    uncached = model.generate(prompt, max_new_tokens=8, greedy=True, eos_token_id=None, use_cache=False)
    # reference: recompute the full sequence each step
    ref = prompt
    with torch.no_grad():
        for _ in range(8):
            nxt = model(ref).logits[:, -1].argmax(-1, keepdim=True)
            ref = torch.cat([ref, nxt], dim=-1)
    assert cached.shape == (2, 13)
    assert torch.equal(cached[:, :5], prompt)
    assert torch.equal(cached, uncached)
    assert torch.equal(cached, ref)
    # temperature == 0 means greedy too
    assert torch.equal(model.generate(prompt, max_new_tokens=8, temperature=0.0, eos_token_id=None), cached)


@pytest.mark.parametrize("use_cache", [True, False])
def test_generate_stops_at_eos_and_pads(use_cache: bool) -> None:
    torch.manual_seed(0)
    model = MiniMindForCausalLM(tiny_config()).eval()
    eos = 2
    emit_eos_at = {0: 1, 1: 3}  # row -> decoding step at which it emits eos (only at that step)
    step = {"n": 0}

    def force_eos(module, inputs, output):
        output = output.clone()
        for row, at in emit_eos_at.items():
            if step["n"] == at:
                output[row, -1, eos] = 1e4
            else:
                output[row, -1, eos] = -1e4  # never emit eos otherwise
        step["n"] += 1
        return output

    handle = model.lm_head.register_forward_hook(force_eos)
    try:
        prompt = torch.randint(3, 6400, (2, 4))
        out = model.generate(prompt, max_new_tokens=10, greedy=True, eos_token_id=eos, use_cache=use_cache)
    finally:
        handle.remove()
    new = out[:, 4:]
    assert new.shape == (2, 4)  # stopped after the step where the last row finished
    assert step["n"] == 4
    assert new[0, 0] != eos and torch.all(new[0, 1:] == eos)  # row 0 finished at step 1, then padded
    assert torch.all(new[1, :3] != eos) and new[1, 3] == eos


def test_generate_sampling_runs() -> None:
    torch.manual_seed(0)
    model = MiniMindForCausalLM(tiny_config()).eval()
    prompt = torch.randint(3, 6400, (3, 4))
    g = torch.Generator().manual_seed(123)
    a = model.generate(prompt, max_new_tokens=5, temperature=0.8, top_k=50, top_p=0.9, eos_token_id=None, generator=g)
    g = torch.Generator().manual_seed(123)
    b = model.generate(prompt, max_new_tokens=5, temperature=0.8, top_k=50, top_p=0.9, eos_token_id=None, generator=g)
    assert a.shape == (3, 9) and torch.equal(a, b)
    # top_k=1 collapses sampling onto greedy
    c = model.generate(prompt, max_new_tokens=5, top_k=1, eos_token_id=None)
    assert torch.equal(c, model.generate(prompt, max_new_tokens=5, greedy=True, eos_token_id=None))


def test_ddp_does_not_broadcast_the_rope_tables() -> None:
    """MiniMind's ``_ddp_params_and_buffers_to_ignore``: DDP would otherwise re-send them every window."""
    from lit_minimind.model.module import LitMiniMind

    module = LitMiniMind(hidden_size=64, num_hidden_layers=2)
    buffers = dict(module.named_buffers())
    assert module._ddp_params_and_buffers_to_ignore == ["model.model.freqs_cos", "model.model.freqs_sin"]
    assert all(name in buffers for name in module._ddp_params_and_buffers_to_ignore)
    assert set(buffers) == set(module._ddp_params_and_buffers_to_ignore)  # nothing else left to broadcast
