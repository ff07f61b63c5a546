"""MiniMind's LoRA stage (``trainer/train_lora.py``) on the same machinery as pretraining.

Fixtures: ``../shared/minimind/post`` (MiniMind commit d65ef2c, 64x2 model, CPU, fp32), starting from
MiniMind's own SFT export. The runs go through MiniMind's argv after ``--config conf/minimind_lora.yaml``
with ``--save_dir out``, as a user of MiniMind's scripts would.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers.runs import (
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


def test_minimind_lora_argv_reproduces_its_run_and_minimind_loads_the_adapters(tmp_path: Path) -> None:
    need_shared()
    start_from_sft(tmp_path)
    run = run_cli(tmp_path, minimind_argv("lora_full"))
    assert run.returncode == 0, run.stderr[-3000:]
    assert "--lora_name lora_tutor -> --resume.weight lora_tutor --model.lora_rank 16" in run.stdout
    assert "--from_weight: loaded 25 tensors from out/full_sft_64.pth" in run.stdout
    assert_steps(run.steps, RUNS["lora_full"]["steps"], "logits_loss")

    # MiniMind's files: out/lora_tutor_64.pth holds the adapters only (fp16, MiniMind's keys), equal to
    # MiniMind's own output; the SFT weights it started from are untouched
    export = torch.load(tmp_path / "out" / "lora_tutor_64.pth", weights_only=True)
    original = torch.load(POST / "out__lora_tutor_64.pth", weights_only=True)
    assert list(export) == list(original)
    for key, value in original.items():
        assert export[key].dtype == torch.float16
        assert torch.allclose(export[key].float(), value.float(), atol=2e-3, rtol=0), key
    assert (tmp_path / "out" / "full_sft_64.pth").read_bytes() == SFT_EXPORT.read_bytes()

    # the resume file is small: the adapters (fp32 for our exact resume, fp16 as MiniMind's "model"),
    # their AdamW moments and the loop state; the frozen base is --from_weight's file, checksummed
    resume = torch.load(tmp_path / "checkpoints" / "lora_tutor_64_resume.pth", weights_only=True)
    assert (resume["epoch"], resume["step"], resume["world_size"]) == (1, 10, 1)
    assert list(resume["model"]) == list(original)
    assert [k for k in resume["state_dict"] if k.startswith("model.")] == [f"model.{k}" for k in original]
    assert resume["start_weights"]["path"] == "out/full_sft_64.pth"
    size = (tmp_path / "checkpoints" / "lora_tutor_64_resume.pth").stat().st_size
    assert size < (POST / "checkpoints__lora_tutor_64_resume.e0s5.pth").stat().st_size / 5, size

    # what MiniMind does with them: load_lora / merge_lora, and --from_resume 1 (strict=False)
    from lit_minimind.model.lora import load_lora

    model = minimind_model(lora=True)
    model.load_state_dict(torch.load(SFT_EXPORT, weights_only=True), strict=False)
    assert load_lora(model, export) == 4  # q_proj and o_proj of both layers
    result = model.load_state_dict(resume["model"], strict=False)
    assert not result.unexpected_keys
    lora_params = [p for n, p in model.named_parameters() if "lora" in n]
    torch.optim.AdamW(lora_params, lr=1e-4).load_state_dict(resume["optimizer"])


def test_from_resume_continues_minimind_lora_file(tmp_path: Path) -> None:
    need_shared()
    start_from_sft(tmp_path)
    (tmp_path / "checkpoints").mkdir()
    shutil.copy(POST / "checkpoints__lora_tutor_64_resume.e0s5.pth", tmp_path / "checkpoints" / "lora_tutor_64_resume.pth")
    run = run_cli(tmp_path, minimind_argv("lora_resumed"))  # with --from_resume 1
    assert run.returncode == 0, run.stderr[-3000:]
    assert "--from_resume 1 -> --ckpt_path last" in run.stdout
    assert "resuming epoch 1 at step 6/10: skipping 5 trained batches" in run.stderr
    assert_steps(run.steps, RUNS["lora_resumed"]["steps"], "logits_loss")


@pytest.mark.slow
def test_kill_anywhere_lora(tmp_path: Path) -> None:
    """SIGKILLed after random console lines and inside saves (mid accumulation window), resumed with
    --ckpt_path last: the per-step losses and final adapters of a run never interrupted, bit for bit."""
    need_shared()
    ref_dir, kill_dir = tmp_path / "ref", tmp_path / "killed"
    start_from_sft(ref_dir), start_from_sft(kill_dir)
    args = tiny_lora_args() + ["--data.add_system_ratio", "0.2", "--data.empty_think_ratio", "0.2"]
    ref = run_cli(ref_dir, args)
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert len(ref.steps) == 20
    runs = run_until_done(kill_dir, args, random.Random("kill-lora"), kills=3, total_lines=20, stem="lora_medical_64",
                          iters=10)
    assert len(runs) >= 2, "no kill happened"
    assert_steps_match(runs, ref)
    assert_same_files(ref_dir, kill_dir, ["out/lora_medical_64.pth", "checkpoints/lora_medical_64_resume.pth"])


@pytest.mark.slow
def test_resume_refuses_a_changed_base(tmp_path: Path) -> None:
    """The frozen base is not in the checkpoint: a resume rebuilds it from --from_weight and refuses,
    in one line, a file that changed since."""
    need_shared()
    start_from_sft(tmp_path)
    args = tiny_lora_args() + ["--trainer.max_steps", "2"]
    first = run_cli(tmp_path, args)
    assert first.returncode == 0, first.stderr[-3000:]
    assert (tmp_path / "out" / "lora_medical_64.pth").is_file()  # LoRA: files named as MiniMind's default
    weights = torch.load(tmp_path / "out" / "full_sft_64.pth", weights_only=True)
    weights["lm_head.weight"] = weights["lm_head.weight"] * 2
    torch.save(weights, tmp_path / "out" / "full_sft_64.pth")
    again = run_cli(tmp_path, [*args[:-2], "--trainer.max_steps", "4", "--ckpt_path", "last"])
    assert again.returncode == 2
    error = again.stderr.strip().splitlines()[-1]
    assert "--from_weight out/full_sft_64.pth (the LoRA base) changed since the checkpoint was written" in again.stderr, error


def test_adapters_follow_minimind_and_merge() -> None:
    """Rank 16 on every square Linear (q_proj, o_proj), B zero so the output is the base's; the forward
    adds B(A(x)); merging adds B @ A to the weight in fp16, as MiniMind's merge_lora."""
    need_shared()  # minimind_model reads the shared parity config
    from lit_minimind.model.lora import freeze_base, merged_state

    torch.manual_seed(0)
    base = minimind_model()
    torch.manual_seed(0)
    model = minimind_model(lora=True)
    x = torch.randint(0, 6400, (2, 16))
    assert torch.equal(model(x).logits, base(x).logits)  # B = 0
    adapters = [n for n, _ in model.named_modules() if n.endswith(".lora")]
    assert adapters == [f"model.layers.{i}.self_attn.{p}.lora" for i in (0, 1) for p in ("q_proj", "o_proj")]
    trainable = freeze_base(model)
    assert len(trainable) == 8 and all(p.requires_grad for p in trainable)
    assert not any(p.requires_grad for n, p in model.named_parameters() if ".lora." not in n)
    for name, module in model.named_modules():
        if name.endswith(".lora"):
            assert module.A.weight.shape == (16, 64) and 0.01 < float(module.A.weight.detach().std()) < 0.03
            torch.nn.init.normal_(module.B.weight, std=0.02)
    merged = merged_state(model)
    assert not any(".lora." in k for k in merged) and all(v.dtype == torch.float16 for v in merged.values())
    q = model.model.layers[0].self_attn.q_proj
    assert torch.equal(merged["model.layers.0.self_attn.q_proj.weight"],
                       q.weight.half() + (q.lora.B.weight @ q.lora.A.weight).half())
    plain = minimind_model()
    plain.load_state_dict({k: v.float() for k, v in merged.items()})
    assert torch.allclose(plain(x).logits, model(x).logits, atol=5e-2)


@pytest.mark.slow
def test_merge_lora_and_generate_with_the_adapters(tmp_path: Path) -> None:
    """MiniMind's outputs: its SFT export + its LoRA adapters merge into one fp16 file, MiniMind's
    merge_lora formula; generate --lora (unmerged) answers as the merged file does."""
    import subprocess
    import sys

    from lit_minimind.model.lora import load_lora

    need_shared()
    out = tmp_path / "merged.pth"
    merge = subprocess.run([sys.executable, "-m", "lit_minimind.merge_lora", str(SFT_EXPORT), str(POST / "out__lora_tutor_64.pth"),
                            "--out", str(out)], env=cli_env(), capture_output=True, text=True, timeout=120)
    assert merge.returncode == 0, merge.stderr[-2000:]
    assert "merged 4 LoRA adapters" in merge.stdout
    merged = torch.load(out, weights_only=True)
    base = torch.load(SFT_EXPORT, weights_only=True)
    assert set(merged) == set(base) and all(v.dtype == torch.float16 for v in merged.values())
    model = minimind_model(lora=True)
    model.load_state_dict(base, strict=False)
    load_lora(model, torch.load(POST / "out__lora_tutor_64.pth", weights_only=True))
    o_proj = model.model.layers[1].self_attn.o_proj
    assert torch.equal(merged["model.layers.1.self_attn.o_proj.weight"],
                       o_proj.weight.half() + (o_proj.lora.B.weight @ o_proj.lora.A.weight).half())
    assert torch.equal(merged["model.layers.0.mlp.up_proj.weight"], base["model.layers.0.mlp.up_proj.weight"])

    def answer(*args: str) -> str:
        run = subprocess.run([sys.executable, "-m", "lit_minimind.generate", *args, "--chat", "What is a list?",
                              "--tokenizer_path", str(TOKENIZER), "--temperature", "0", "--max_new_tokens", "12"],
                             env=cli_env(), capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr[-2000:]
        return run.stdout

    assert answer(str(SFT_EXPORT), "--lora", str(POST / "out__lora_tutor_64.pth")) == answer(str(out))
    bad = subprocess.run([sys.executable, "-m", "lit_minimind.merge_lora", str(SFT_EXPORT), str(SFT_EXPORT)],
                         env=cli_env(), capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "no LoRA adapter tensors" in bad.stderr


def test_minimind_lora_and_dpo_flags_translate() -> None:
    from lit_minimind.cli.flags import translate

    assert translate(["--lora_name", "lora_identity"]).args == ["--resume.weight", "lora_identity", "--model.lora_rank", "16"]
    # a rank given anywhere wins (the flag then only names the files)
    assert translate(["--model.lora_rank", "8", "--lora_name=x"]).args == ["--model.lora_rank", "8", "--resume.weight", "x"]
    assert translate(["--beta", "0.1"]).args == ["--model.beta", "0.1"]
    wandb = translate(["--lora_name", "x", "--use_wandb"]).args
    assert wandb[wandb.index("--trainer.logger.init_args.project") + 1] == "MiniMind-LoRA"
    wandb = translate(["--beta", "0.1", "--use_wandb"]).args
    assert wandb[wandb.index("--trainer.logger.init_args.project") + 1] == "MiniMind-DPO"


def test_minimind_flags_override_a_preset_given_after_them() -> None:
    """MiniMind's argv with the preset appended: its flags still win (they override the script's defaults)."""
    from lit_minimind.cli.flags import translate

    args = translate(["--hidden_size", "64", "--config", "conf/minimind_lora.yaml", "--trainer.max_steps", "3"]).args
    assert args == ["--config", "conf/minimind_lora.yaml", "--model.hidden_size", "64", "--trainer.max_steps", "3"]
    assert translate(["--model.hidden_size", "64", "--config=x.yaml"]).args == ["--model.hidden_size", "64", "--config=x.yaml"]
