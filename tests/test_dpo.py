"""MiniMind's DPO stage (``trainer/train_dpo.py``): its data, its loss and its runs, reproduced.

Fixtures: ``../shared/minimind/post`` (MiniMind commit d65ef2c, 64x2 model, CPU, fp32).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers.runs import (
    MINIMIND,
    POST,
    RUNS,
    SFT_EXPORT,
    TOKENIZER,
    assert_same_files,
    assert_steps,
    assert_steps_match,
    cli_env,
    minimind_argv,
    minimind_model,
    need_shared,
    run_cli,
    run_until_done,
    start_from_sft,
    tiny_lora_args,
)

DPO_JSONL = POST / "dpo.jsonl"


@pytest.mark.parametrize("max_length", [128, 384])
def test_dpo_dataset_equals_minimind(max_length: int) -> None:
    """Both sides rendered with MiniMind's chat template, the assistant-token mask, the padding and the
    shift: MiniMind's DPODataset tensors, exactly."""
    need_shared()
    from lit_minimind.data.chat_template import load_chat_template
    from lit_minimind.data.dpo import DPODataset
    from lit_minimind.data.tokenizer import load_tokenizer

    dataset = DPODataset(DPO_JSONL, load_tokenizer(TOKENIZER), max_length, load_chat_template(TOKENIZER),
                         empty_think_ratio=0)
    expected = torch.load(POST / "dpo_dataset_expected.pth")[f"len{max_length}"]
    assert len(dataset) == expected["x_chosen"].shape[0]
    for key, tensor in expected.items():
        got = torch.stack([dataset[i][key] for i in range(len(dataset))])
        assert got.dtype == tensor.dtype and torch.equal(got, tensor), key
    assert expected["mask_chosen"].sum() > 0 and (expected["mask_chosen"] != expected["mask_rejected"]).any()


def test_dpo_kind_detected_and_bad_records_named(tmp_path: Path) -> None:
    need_shared()
    from lit_minimind.data.dataset import detect_kind
    from lit_minimind.data.dpo import DPODataset
    from lit_minimind.data.tokenizer import load_tokenizer
    from lit_minimind.errors import DataError

    assert detect_kind(DPO_JSONL) == "dpo"
    first = DPO_JSONL.read_text().splitlines()[0]
    cases = {
        '{"chosen": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}': 'line 2: DPO record without "rejected"',
        '{"text": "plain"}': 'line 2: a pretraining record ("text") in a DPO (preference pair) data',
        '{"chosen": [], "rejected": []}': 'line 2: chosen: "chosen" is empty',
        '{"chosen": [{"role": "bot", "content": "x"}], "rejected": [{"role": "user", "content": "x"}]}':
            "line 2: chosen: chosen[0]: unknown role 'bot'",
    }
    tokenizer = load_tokenizer(TOKENIZER)
    for line, message in cases.items():
        path = tmp_path / "bad.jsonl"
        path.write_text(first + "\n" + line + "\n")
        with pytest.raises(DataError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            DPODataset(path, tokenizer, 64)
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(json.dumps({"text": "x", "chosen": []}) + "\n")
    with pytest.raises(DataError, match='both "text" and "chosen"; cannot tell pretraining from DPO'):
        detect_kind(mixed)


def test_embedded_pairs_are_dpo_records() -> None:
    from lit_minimind.data.corpus import embedded_pairs
    from lit_minimind.data.dpo import check_dpo_record

    pairs = embedded_pairs()
    assert len(pairs) > 20
    for i, pair in enumerate(pairs):
        check_dpo_record(pair, f"pair {i}")
        assert pair["chosen"][0] == pair["rejected"][0] and pair["chosen"][1] != pair["rejected"][1]


# ----------------------------------------------------------------------------- training


def test_minimind_dpo_argv_reproduces_its_run_and_minimind_loads_the_export(tmp_path: Path) -> None:
    need_shared()
    start_from_sft(tmp_path)
    run = run_cli(tmp_path, minimind_argv("dpo_full", preset_last=True))  # MiniMind's flags still win
    assert run.returncode == 0, run.stderr[-3000:]
    assert "--beta 0.15 -> --model.beta 0.15" in run.stdout
    assert (tmp_path / "out" / "dpo_64.pth").is_file()
    assert_steps(run.steps, RUNS["dpo_full"]["steps"], "dpo_loss")
    assert "dpo_loss: 0.6931, aux_loss: 0.0000, learning_rate: 0.00000993, epoch_time: 0.000min" in run.stdout

    export = torch.load(tmp_path / "out" / "dpo_64.pth", weights_only=True)
    original = torch.load(POST / "out__dpo_64.pth", weights_only=True)
    assert list(export) == list(original)
    for key, value in original.items():
        assert export[key].dtype == torch.float16
        assert torch.allclose(export[key].float(), value.float(), atol=2e-3, rtol=0), key
    resume = torch.load(tmp_path / "checkpoints" / "dpo_64_resume.pth", weights_only=True)
    model = minimind_model()
    model.load_state_dict(export, strict=True)  # eval_llm.py / --from_weight dpo
    model.load_state_dict(resume["model"], strict=True)  # train_dpo.py --from_resume 1
    torch.optim.AdamW(model.parameters(), lr=1e-5).load_state_dict(resume["optimizer"])
    # the reference is in no checkpoint (policy keys only), its start file is recorded
    assert {k for k in resume["state_dict"] if k.startswith("model.")} == {f"model.{k}" for k in export}
    assert resume["start_weights"]["path"] == "out/full_sft_64.pth"

    # what preference trainers log, per micro-batch, beside MiniMind's numbers
    import csv

    rows = list(csv.DictReader(open(next(tmp_path.glob("lightning_logs/version_*/metrics.csv")))))
    logged = [r for r in rows if r.get("dpo_loss")]
    assert len(logged) == 18
    first = logged[0]
    assert float(first["rewards/chosen"]) == 0.0 and float(first["rewards/margin"]) == 0.0  # policy == reference
    assert float(first["rewards/accuracy"]) == 0.0  # no pair's chosen reward above its rejected one yet
    for row in logged:  # a fraction of the micro-batch's pairs (4, fewer in an epoch's last batch)
        accuracy = float(row["rewards/accuracy"])
        assert any(math.isclose(accuracy * n, k, abs_tol=1e-6) for n in range(1, 5) for k in range(n + 1)), row
    last = logged[-1]
    # a positive mean margin: at least one pair's chosen reward is ahead
    assert float(last["rewards/margin"]) > 0 and float(last["rewards/accuracy"]) > 0
    assert abs(float(last["rewards/chosen"]) - float(last["rewards/rejected"]) - float(last["rewards/margin"])) < 1e-5


@pytest.mark.slow  # make test's budget: 14.6 min on a clean clone, 2026-12-03 (make test-slow)
def test_from_resume_continues_minimind_dpo_file(tmp_path: Path) -> None:
    need_shared()
    start_from_sft(tmp_path)
    (tmp_path / "checkpoints").mkdir()
    shutil.copy(POST / "checkpoints__dpo_64_resume.e0s5.pth", tmp_path / "checkpoints" / "dpo_64_resume.pth")
    run = run_cli(tmp_path, minimind_argv("dpo_resumed"))
    assert run.returncode == 0, run.stderr[-3000:]
    assert "resuming epoch 1 at step 6/9: skipping 5 trained batches" in run.stderr
    assert_steps(run.steps, RUNS["dpo_resumed"]["steps"], "dpo_loss")


def tiny_dpo_args(*extra: str) -> list[str]:
    return ["--data.data_path", str(DPO_JSONL), "--data.tokenizer_path", str(TOKENIZER),
            "--model.hidden_size", "64", "--model.num_hidden_layers", "2", "--data.max_seq_len", "128",
            "--data.batch_size", "4", "--model.learning_rate", "1e-4", "--trainer.accumulate_grad_batches", "2",
            "--trainer.max_epochs", "2", "--trainer.accelerator", "cpu", "--trainer.devices", "1",
            "--log_interval", "1", "--resume.save_interval", "3", "--trainer.enable_progress_bar", "false",
            "--trainer.enable_model_summary", "false", *extra]


@pytest.mark.slow  # make test-slow: keeps make test under its budget
@pytest.mark.parametrize("moe", [False, True])
def test_kill_anywhere_dpo(tmp_path: Path, moe: bool) -> None:
    """SIGKILLed after random console lines and inside saves (mid accumulation window), resumed with
    --ckpt_path last: the reference is rebuilt from --from_weight and the per-step losses and final
    weights are those of a run never interrupted, bit for bit (MoE: the aux loss too)."""
    import random


    need_shared()
    ref_dir, kill_dir = tmp_path / "ref", tmp_path / "killed"
    start = str(SFT_EXPORT) if not moe else "none"
    extra = ["--from_weight", start, "--data.empty_think_ratio", "0.2"]
    if moe:  # a DPO run from a MoE SFT model of our own, made first
        (tmp_path / "sft").mkdir()
        sft = run_cli(tmp_path / "sft", ["--data.data_path", str(MINIMIND / "sft" / "sft.jsonl"), "--data.tokenizer_path",
                                str(TOKENIZER), "--model.hidden_size", "64", "--model.num_hidden_layers", "2",
                                "--model.use_moe", "true", "--data.max_seq_len", "64", "--data.batch_size", "8",
                                "--trainer.max_steps", "2", "--trainer.enable_progress_bar", "false"])
        assert sft.returncode == 0, sft.stderr[-3000:]
        shutil.copy(tmp_path / "sft" / "out" / "full_sft_64_moe.pth", tmp_path / "moe_sft.pth")
        extra[1] = str(tmp_path / "moe_sft.pth")
        extra += ["--model.use_moe", "true"]
    args = tiny_dpo_args(*extra)
    kill_dir.mkdir(parents=True, exist_ok=True)
    ref_dir.mkdir(parents=True, exist_ok=True)
    ref = run_cli(ref_dir, args)
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert len(ref.steps) == 18
    runs = run_until_done(kill_dir, args, random.Random(f"kill-dpo-{moe}"), kills=3, total_lines=18,
                          stem=f"dpo_64{'_moe' if moe else ''}", iters=9)
    assert len(runs) >= 2, "no kill happened"
    assert_steps_match(runs, ref)
    suffix = "_moe" if moe else ""
    assert_same_files(ref_dir, kill_dir, [f"out/dpo_64{suffix}.pth", f"checkpoints/dpo_64{suffix}_resume.pth"])


@pytest.mark.slow
def test_dpo_resume_refuses_a_changed_reference_and_needs_one(tmp_path: Path) -> None:
    need_shared()
    start_from_sft(tmp_path)
    args = tiny_dpo_args("--from_weight", "full_sft", "--trainer.max_steps", "1")
    first = run_cli(tmp_path, args)
    assert first.returncode == 0, first.stderr[-3000:]
    weights = torch.load(tmp_path / "out" / "full_sft_64.pth", weights_only=True)
    weights["model.norm.weight"] = weights["model.norm.weight"] + 1
    torch.save(weights, tmp_path / "out" / "full_sft_64.pth")
    again = run_cli(tmp_path, [*args[:-2], "--trainer.max_steps", "2", "--ckpt_path", "last"])
    assert again.returncode == 2
    assert "(the reference model) changed since the checkpoint was written" in again.stderr.strip().splitlines()[-1]
    none = run_cli(tmp_path, tiny_dpo_args("--from_weight", "none", "--trainer.max_steps", "1"))
    assert none.returncode == 2
    assert none.stderr.strip().splitlines()[-1] == (
        "error: DPO needs --from_weight: the frozen reference model is built from it (MiniMind: full_sft)")


def test_reference_is_outside_the_module() -> None:
    """Not a parameter, buffer or state of the LightningModule (so DDP neither wraps nor broadcasts it,
    no optimizer or checkpoint holds it); frozen, no gradients."""
    need_shared()
    from lit_minimind.model.module import LitMiniMind

    module = LitMiniMind(hidden_size=64, num_hidden_layers=2, objective="dpo")
    module.model.load_state_dict(torch.load(SFT_EXPORT, weights_only=True))  # what --from_weight does
    module.use_start_weights(SFT_EXPORT)
    module.reference = module._build_reference(str(SFT_EXPORT), module.start_weights["sha256"])
    n_params = sum(1 for _ in module.parameters())
    assert n_params == sum(1 for _ in module.model.parameters())
    assert not any(k.startswith("reference") for k in module.state_dict())
    assert not any(p.requires_grad for p in module.reference.model.parameters())
    batch = {k: v[:2] for k, v in torch.load(POST / "dpo_dataset_expected.pth")["len128"].items()}
    loss, stats = module.dpo_step(batch)
    loss.backward()
    assert all(p.grad is None for p in module.reference.model.parameters())
    assert abs(float(stats["dpo_loss"]) - 0.6931) < 1e-4  # policy == reference: -log sigmoid(0)


@pytest.mark.slow
def test_embedded_sft_then_lora_and_dpo_then_chat(tmp_path: Path) -> None:
    """The README's SFT -> LoRA / DPO -> chat, shortened: nothing downloaded (the embedded chat corpus,
    its preference pairs and tokenizer); the stages' default names and start weights."""
    import subprocess
    import sys

    short = ["--data.max_seq_len", "64", "--trainer.max_steps", "2", "--trainer.enable_progress_bar", "false",
             "--log_interval", "1"]
    sft = run_cli(tmp_path, ["--data.kind", "sft", *short])
    assert sft.returncode == 0, sft.stderr[-3000:]
    lora = run_cli(tmp_path, ["--data.kind", "sft", "--lora_name", "lora_pydoc", *short])
    assert lora.returncode == 0, lora.stderr[-3000:]
    assert "LoRA: --from_weight full_sft (MiniMind's train_lora.py default)" in lora.stdout
    assert "--from_weight: loaded 25 tensors from out/full_sft_128.pth" in lora.stdout and len(lora.steps) == 2
    assert list(torch.load(tmp_path / "out" / "lora_pydoc_128.pth", weights_only=True))[0] == \
        "model.layers.0.self_attn.q_proj.lora.A.weight"
    dpo = run_cli(tmp_path, ["--data.kind", "dpo", *short])
    assert dpo.returncode == 0, dpo.stderr[-3000:]
    assert "DPO data: files named dpo" in dpo.stdout and "DPO: --from_weight full_sft" in dpo.stdout
    assert len(dpo.steps) == 2 and (tmp_path / "out" / "dpo_128.pth").is_file()
    for args in (["out/full_sft_128.pth", "--lora", "out/lora_pydoc_128.pth"], ["out/dpo_128.pth"]):
        chat = subprocess.run([sys.executable, "-m", "lit_minimind.generate", *args, "--chat", "What is a list?",
                               "--temperature", "0", "--max_new_tokens", "8"],
                              cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=120)
        assert chat.returncode == 0, chat.stderr[-2000:]
        assert chat.stdout.strip() and "<|im_start|>" not in chat.stdout


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["lora", "dpo"])
def test_ddp_two_processes_killed_mid_window_resume_exactly(tmp_path: Path, stage: str) -> None:
    """LoRA and DPO under DDP (gloo, 2 processes): SIGKILLed after the save that fell due inside an
    accumulation window (step 3, accumulation 2) and was taken at its optimizer step (4), resumed: the
    per-step values and final weights of the uninterrupted run.
    The DPO reference is outside DDP (each rank rebuilds it from --from_weight)."""
    need_shared()
    ddp = ["--trainer.devices", "2", "--trainer.strategy", "ddp"]
    args = (tiny_lora_args() if stage == "lora" else tiny_dpo_args("--from_weight", "out/full_sft_64.pth")) + ddp
    ref_dir, kill_dir = tmp_path / "ref", tmp_path / "killed"
    start_from_sft(ref_dir), start_from_sft(kill_dir)
    ref = run_cli(ref_dir, args)
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert len(ref.steps) == 10  # 2 epochs x 5 batches per rank
    # killed right after the step-4 save's last file (its export, the 3rd commit)
    killed = run_cli(kill_dir, args + ["--ckpt_path", "last"], env=cli_env(LIT_MINIMIND_TEST_STOP_AFTER_SAVE="1:export"))
    assert killed.returncode == -9 and "@@stopped-after-save" in killed.stdout
    resumed = run_cli(kill_dir, args + ["--ckpt_path", "last"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming epoch 1 at step 5/5" in resumed.stderr  # from the step-4 save
    for key, values in resumed.steps.items():
        assert values == ref.steps[key], f"step {key} differs after the DDP resume"
    name = "out/lora_medical_64.pth" if stage == "lora" else "out/dpo_64.pth"
    ref_out, out = (torch.load(d / name, weights_only=True) for d in (ref_dir, kill_dir))
    assert ref_out.keys() == out.keys() and all(torch.equal(ref_out[k], out[k]) for k in ref_out)
