"""MiniMind's distillation (``trainer/train_distillation.py``): its loss, its runs and its resume file,
reproduced; a teacher of any shape; exact resume; a changed teacher refused.

Fixture: ``tests/fixtures/distill`` (made by its ``make_minimind_distill.py`` from MiniMind d65ef2c: a dense
64x2 student from MiniMind's SFT export, a 64x2 MoE teacher from MiniMind's pretraining export, CPU, fp32).
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.runs import (
    DISTILL_RE,
    MINIMIND,
    QUIET,
    SFT_EXPORT,
    SHARED,
    TOKENIZER,
    assert_same_files,
    assert_steps_match,
    minimind_model,
    need_shared,
    run_cli,
    run_until_done,
)

FIXTURE = Path(__file__).parent / "fixtures" / "distill"
RUNS = json.loads((FIXTURE / "runs.json").read_text())
MOE_TEACHER = MINIMIND / "original_run" / "out__pretrain_64_moe.pth"
SFT_JSONL = MINIMIND / "sft" / "sft.jsonl"


def minimind_distillation_loss(student: torch.Tensor, teacher: torch.Tensor, labels: torch.Tensor, alpha: float,
                               temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """train_distillation.py's loss, as MiniMind writes it (boolean row selection, F.kl_div batchmean)."""
    student, teacher = student[..., :-1, :], teacher[..., :-1, : student.size(-1)]
    mask = (labels[..., 1:] != -100).float().view(-1)
    ce = F.cross_entropy(student.reshape(-1, student.size(-1)), labels[..., 1:].reshape(-1), ignore_index=-100,
                         reduction="none")
    ce = torch.sum(ce * mask) / (mask.sum() + 1e-8)
    rows_s = student.reshape(-1, student.size(-1))[mask == 1]
    rows_t = teacher.reshape(-1, teacher.size(-1))[mask == 1]
    kl = F.kl_div(F.log_softmax(rows_s / temperature, -1), F.softmax(rows_t / temperature, -1), reduction="batchmean")
    kl = temperature**2 * kl
    return alpha * ce + (1 - alpha) * kl, ce, kl


def test_distill_loss_is_miniminds() -> None:
    """The mask-product form equals MiniMind's row selection (a teacher with a larger vocabulary cut to the
    student's); a batch without a labelled row gives 0, where MiniMind's gives NaN."""
    from lit_minimind.model.distill import distill_loss

    gen = torch.Generator().manual_seed(0)
    student = torch.randn(3, 9, 50, generator=gen, requires_grad=True)
    teacher = torch.randn(3, 9, 57, generator=gen) * 3
    labels = torch.randint(0, 50, (3, 9), generator=gen)
    labels[0, :5] = -100
    labels[2] = -100
    loss, stats = distill_loss(student, teacher, labels, 0.3, 1.7, torch.zeros(()))
    want, ce, kl = minimind_distillation_loss(student, teacher, labels, 0.3, 1.7)
    assert torch.allclose(loss, want, atol=1e-6) and torch.allclose(stats["ce"], ce) and torch.allclose(stats["distill"], kl, atol=1e-6)
    assert float(kl.detach()) > 0.1  # the two differ: the test compares something
    grad, = torch.autograd.grad(loss, student)
    want_grad, = torch.autograd.grad(want, student)
    assert torch.allclose(grad, want_grad, atol=1e-7)
    empty, stats = distill_loss(student, teacher, torch.full_like(labels, -100), 0.5, 1.5, torch.zeros(()))
    assert float(empty.detach()) == 0.0 and float(stats["distill"]) == 0.0


def test_teacher_of_another_shape(tmp_path: Path) -> None:
    """A teacher wider and deeper than the student, with a larger vocabulary, is read from its tensors; a shape
    given that its file does not have is refused, naming the flag."""
    from lit_minimind.errors import CheckpointError
    from lit_minimind.model import MiniMindConfig, MiniMindForCausalLM
    from lit_minimind.model.distill import load_teacher

    torch.manual_seed(1)
    big = MiniMindForCausalLM(MiniMindConfig(hidden_size=96, num_hidden_layers=3, vocab_size=6500))
    path = tmp_path / "teacher_96.pth"
    torch.save({k: v.half() for k, v in big.state_dict().items()}, path)
    before = torch.random.get_rng_state()
    teacher = load_teacher(path, hidden_size=96)
    assert torch.equal(torch.random.get_rng_state(), before)  # built without drawing from the training's stream
    assert teacher.model.config.num_hidden_layers == 3 and teacher.model.config.vocab_size == 6500
    assert not any(p.requires_grad for p in teacher.model.parameters()) and not teacher.model.training
    logits = teacher.logits(torch.tensor([[1, 5, 9]]), like=torch.zeros((), dtype=torch.float32))
    assert logits.shape == (1, 3, 6500)
    with pytest.raises(CheckpointError, match="--model.teacher_num_layers 2 but the file has 3"):
        load_teacher(path, num_hidden_layers=2)
    with pytest.raises(CheckpointError, match="no such weight file"):
        load_teacher(tmp_path / "none.pth")


def minimind_argv(run: str) -> list[str]:
    """``--config minimind_distill`` (MiniMind's defaults, the augmentation pinned), runs.json's argv of MiniMind's
    script with the shared data, ``--save_dir out`` and the shared tokenizer."""
    argv = [a.replace("<shared>", str(SHARED)) for a in RUNS[run]["argv"][2:]]
    return ["--config", "minimind_distill", *argv, "--save_dir", "out", "--tokenizer_path", str(TOKENIZER), *QUIET]


def place_student_and_teacher(run_dir: Path) -> None:
    """MiniMind's --from_student_weight full_sft (dense) and --from_teacher_weight full_sft --teacher_use_moe 1."""
    (run_dir / "out").mkdir(parents=True, exist_ok=True)
    shutil.copy(SFT_EXPORT, run_dir / "out" / "full_sft_64.pth")
    shutil.copy(MOE_TEACHER, run_dir / "out" / "full_sft_64_moe.pth")


def assert_minimind_steps(stdout: str, expected: list[dict]) -> None:
    got = {(int(e), int(s)): tuple(map(float, rest)) for e, s, *rest in DISTILL_RE.findall(stdout)}
    assert sorted(got) == [(s["epoch"] + 1, s["step"]) for s in expected]
    for s in expected:
        loss, ce, aux, distill, lr = got[(s["epoch"] + 1, s["step"])]
        where = (s["epoch"], s["step"])
        assert abs(loss - s["loss"]) <= 2e-4 and abs(ce - s["ce"]) <= 2e-4, (where, loss, ce, s)
        assert abs(distill - s["distill"]) <= 2e-4 and abs(aux - s["aux_loss"]) <= 2e-4, (where, distill, s)
        assert abs(lr - s["lr"]) <= 1e-8, (where, lr, s["lr"])


@pytest.mark.slow  # make test's budget: 14.6 min on a clean clone, 2026-12-03 (make test-slow)
def test_minimind_distill_argv_reproduces_its_run(tmp_path: Path) -> None:
    need_shared()
    place_student_and_teacher(tmp_path)
    run = run_cli(tmp_path, minimind_argv("distill_full"))
    assert run.returncode == 0, run.stderr[-3000:]
    # the first of train_distillation.py's teacher flags also sets the objective
    assert "--teacher_hidden_size 64 -> --model.objective distill --model.teacher_hidden_size 64" in run.stdout
    assert "--from_teacher_weight full_sft -> --model.teacher full_sft" in run.stdout
    assert "distillation: teacher out/full_sft_64_moe.pth" in run.stdout
    assert_minimind_steps(run.stdout, RUNS["distill_full"]["steps"])
    export = torch.load(tmp_path / "out" / "full_dist_64.pth", weights_only=True)
    resume = torch.load(tmp_path / "checkpoints" / "full_dist_64_resume.pth", weights_only=True)
    model = minimind_model()
    model.load_state_dict(export, strict=True)  # MiniMind's eval_llm.py --weight full_dist
    model.load_state_dict(resume["model"], strict=True)  # train_distillation.py --from_resume 1
    torch.optim.AdamW(model.parameters(), lr=1e-5).load_state_dict(resume["optimizer"])
    # the teacher is in no checkpoint (student keys only); its file is recorded
    assert {k for k in resume["state_dict"] if k.startswith("model.")} == {f"model.{k}" for k in export}
    assert resume["teacher"]["path"] == "out/full_sft_64_moe.pth" and len(resume["teacher"]["sha256"]) == 64


@pytest.mark.slow  # make test's budget: 14.6 min on a clean clone, 2026-12-03 (make test-slow)
def test_from_resume_continues_minimind_distill_file(tmp_path: Path) -> None:
    need_shared()
    place_student_and_teacher(tmp_path)
    (tmp_path / "checkpoints").mkdir()
    shutil.copy(FIXTURE / "checkpoints__full_dist_64_resume.e0s5.pth", tmp_path / "checkpoints" / "full_dist_64_resume.pth")
    run = run_cli(tmp_path, minimind_argv("distill_resumed"))
    assert run.returncode == 0, run.stderr[-3000:]
    assert "resuming epoch 1 at step 6/12: skipping 5 trained batches" in run.stderr
    assert_minimind_steps(run.stdout, RUNS["distill_resumed"]["steps"])


def tiny_distill_args(*extra: str) -> list[str]:
    return ["--model.objective", "distill", "--model.teacher", str(MOE_TEACHER), "--from_weight", str(SFT_EXPORT),
            "--data.data_path", str(SFT_JSONL), "--data.tokenizer_path", str(TOKENIZER), "--model.hidden_size", "64",
            "--model.num_hidden_layers", "2", "--data.max_seq_len", "128", "--data.batch_size", "4",
            "--model.learning_rate", "1e-3", "--trainer.accumulate_grad_batches", "2", "--trainer.max_epochs", "2",
            "--trainer.accelerator", "cpu", "--trainer.devices", "1", "--log_interval", "1",
            "--resume.save_interval", "5", *QUIET, *extra]


@pytest.mark.slow  # make test-slow (budget): make test checks the same refusal for DPO's reference and GRPO's scorer
def test_distill_resume_refuses_a_changed_teacher_and_needs_one(tmp_path: Path) -> None:
    need_shared()
    teacher = tmp_path / "teacher.pth"
    shutil.copy(MOE_TEACHER, teacher)
    args = tiny_distill_args("--trainer.max_steps", "1")
    args[args.index(str(MOE_TEACHER))] = str(teacher)
    first = run_cli(tmp_path, args)
    assert first.returncode == 0, first.stderr[-3000:]
    weights = torch.load(teacher, weights_only=True)
    weights["model.norm.weight"] = weights["model.norm.weight"] + 1
    torch.save(weights, teacher)
    again = run_cli(tmp_path, [*args[:-2], "--trainer.max_steps", "2", "--ckpt_path", "last"])
    assert again.returncode == 2
    assert f"--model.teacher {teacher} changed since the checkpoint was written" in again.stderr.strip().splitlines()[-1]
    (tmp_path / "fresh").mkdir()
    missing = run_cli(tmp_path / "fresh", tiny_distill_args("--trainer.max_steps", "1", "--model.teacher", "none_such"))
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines()[-1] == "error: --model.teacher: out/none_such_64_moe.pth: no such weight file"


@pytest.mark.slow  # make test-slow: keeps make test under its budget
def test_kill_anywhere_distill(tmp_path: Path) -> None:
    """SIGKILLed after random console lines and inside saves, resumed with --ckpt_path last: the teacher is
    read again and every step's losses and the final files are the uninterrupted run's, bit for bit."""
    need_shared()
    ref_dir, kill_dir = tmp_path / "ref", tmp_path / "killed"
    ref_dir.mkdir()
    kill_dir.mkdir()
    args = tiny_distill_args()
    ref = run_cli(ref_dir, args)
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert len(ref.steps) == 24
    runs = run_until_done(kill_dir, args, random.Random("kill-distill"), kills=3, total_lines=24, stem="full_dist_64")
    assert len(runs) >= 2, "no kill happened"
    assert_steps_match(runs, ref)
    assert_same_files(ref_dir, kill_dir, ["out/full_dist_64.pth", "checkpoints/full_dist_64_resume.pth"])
