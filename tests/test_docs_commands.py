"""Every command the docs show (``docs/*.md``, their ``bash`` blocks) either runs here at tiny size or is marked with
what it needs that a test machine has not (``# needs: ...`` on its line, or a ``# needs: ...`` line heading its block:
a GPU, a cluster, MiniMind's downloaded data, the internet, a bucket).

The fast test checks the bookkeeping (a new command in the docs is run here or marked); the slow one runs the docs'
pipeline in a fresh directory, in the docs' order, each command as written plus flags that make it tiny (two
optimizer steps, a few new tokens, port 0): pretraining, SFT, LoRA, DPO, the reward model, GRPO, distillation, chat,
the LoRA merge, the Hugging Face export and the server."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.helpers.runs import ROOT, cli_env

LISTENING = re.compile(r"listening on (http://[\w.\[\]:]+)")
FIT_TINY = ["--trainer.max_steps", "2", "--log_interval", "1"]
TINY = {"lit_minimind.fit": FIT_TINY, "lit_minimind.generate": ["--max_new_tokens", "4"],
        "lit_minimind.serve": ["--port", "0"]}
# the docs' pipeline as the slow test runs it, first to last: (page, the command as the page writes it); make fit's
# run (the embedded default) comes first, as the pages assume it ran
RUN = [
    ("tokenizer.md", ".venv/bin/python -m lit_minimind.train_tokenizer --out_dir my_tokenizer"),
    ("tokenizer.md", ".venv/bin/python -m lit_minimind.fit --data.tokenizer_path my_tokenizer --resume.ckpt_dir my_run/checkpoints "
                     "--resume.out_dir my_run/out"),
    ("sft.md", ".venv/bin/python -m lit_minimind.fit --data.kind sft --from_weight pretrain --data.max_seq_len 256 "
               "--data.empty_think_ratio 1 --trainer.max_epochs 30"),
    ("sft.md", '.venv/bin/python -m lit_minimind.generate out/full_sft_128.pth --chat "What is the assert statement?"'),
    ("sft.md", "printf 'What is the for statement?\\nTell me more.\\n' | .venv/bin/python -m lit_minimind.generate "
               "out/full_sft_128.pth --chat --temperature 0"),
    ("lora-dpo.md", ".venv/bin/python -m lit_minimind.fit --data.kind sft --lora_name lora_pydoc --data.max_seq_len 256 "
                    "--data.empty_think_ratio 1 --trainer.max_epochs 5 --model.learning_rate 1e-3"),
    ("lora-dpo.md", '.venv/bin/python -m lit_minimind.generate out/full_sft_128.pth --lora out/lora_pydoc_128.pth --chat '
                    '"What is the for statement?"'),
    ("lora-dpo.md", ".venv/bin/python -m lit_minimind.merge_lora out/full_sft_128.pth out/lora_pydoc_128.pth"),
    ("lora-dpo.md", ".venv/bin/python -m lit_minimind.fit --data.kind dpo --data.max_seq_len 256 --trainer.max_epochs 2 "
                    "--model.learning_rate 1e-5 --log_interval 5"),
    ("lora-dpo.md", '.venv/bin/python -m lit_minimind.generate out/dpo_128.pth --chat "What is the for statement?"'),
    ("reward-model.md", ".venv/bin/python -m lit_minimind.fit --data.kind dpo --model.objective reward "
                        "--data.val_fraction 0.2 --data.max_seq_len 256 --trainer.max_epochs 2 --model.learning_rate 1e-4"),
    ("grpo.md", ".venv/bin/python -m lit_minimind.fit --model.objective grpo --model.reward_model out/reward_128.pth "
                "--data.thinking_ratio 0 --data.max_seq_len 256 --model.max_gen_len 48 --model.num_generations 4 "
                "--data.batch_size 4 --model.learning_rate 1e-4 --trainer.max_epochs 3"),
    ("grpo.md", '.venv/bin/python -m lit_minimind.generate out/grpo_128.pth --chat "What is the assert statement?"'),
    ("agent-rl.md", ".venv/bin/python -m lit_minimind.fit --model.objective agent --model.max_gen_len 64 --model.num_generations 4 "
                    "--data.batch_size 2 --model.learning_rate 1e-5 --trainer.max_epochs 1 --log_interval 1"),
    ("agent-rl.md", ".venv/bin/python -m lit_minimind.eval_toolcall out/agent_128.pth --max_new_tokens 64"),
    ("ppo.md", ".venv/bin/python -m lit_minimind.fit --model.objective ppo --model.reward_model out/reward_128.pth "
               "--data.thinking_ratio 0 --data.max_seq_len 256 --model.max_gen_len 48 --data.batch_size 4 "
               "--model.mini_batch_size 2 --model.learning_rate 1e-5 --model.critic_learning_rate 1e-4 --trainer.max_epochs 3"),
    ("ppo.md", '.venv/bin/python -m lit_minimind.generate out/ppo_actor_128.pth --chat "What is the assert statement?"'),
    ("distillation.md", ".venv/bin/python -m lit_minimind.fit --data.kind sft --model.objective distill "
                        "--model.hidden_size 64 --from_weight none --model.teacher full_sft --model.teacher_hidden_size 128 "
                        "--model.teacher_use_moe false --data.max_seq_len 256 --data.empty_think_ratio 1 "
                        "--trainer.max_epochs 30"),
    ("distillation.md", '.venv/bin/python -m lit_minimind.generate out/full_dist_64.pth --chat "What is the for statement?"'),
    ("huggingface.md", ".venv/bin/python -m lit_minimind.export out/pretrain_128.pth hf/minimind"),
    ("huggingface.md", ".venv/bin/python -m lit_minimind.export checkpoints/pretrain_128_resume.pth hf/minimind-f32 "
                       "--dtype float32"),
    ("serving.md", ".venv/bin/python -m lit_minimind.serve out/full_sft_128.pth"),
    ("serving.md", ".venv/bin/python -m lit_minimind.serve out/full_sft_128.pth --lora out/lora_pydoc_128.pth "
                   "--port 8000 --api_key sk-mine"),
]


def docs_commands() -> list[tuple[str, str, bool]]:
    """``(page, command, marked)`` of every command in the docs' ``bash`` blocks: continuation lines joined, comments
    cut, whitespace normalised; ``marked``: it says what it needs (``# needs:`` on its line or heading its block)."""
    found = []
    for page in sorted((ROOT / "docs").glob("*.md")):
        for block in re.findall(r"```(?:bash|sh)\n(.*?)```", page.read_text(), re.S):
            block_needs = any(line.strip().startswith("# needs:") for line in block.splitlines())
            for line in block.replace("\\\n", " ").splitlines():
                code, _, comment = line.partition("  #")
                if not code.strip() or code.strip().startswith("#"):
                    continue
                found.append((page.name, " ".join(code.split()), block_needs or "needs:" in comment))
    return found


def test_every_docs_command_runs_here_or_says_what_it_needs() -> None:
    commands = docs_commands()
    assert len(commands) > 20, commands  # the parser found the docs' commands
    run = {(page, " ".join(command.split())) for page, command in RUN}
    unaccounted = [(page, command) for page, command, marked in commands if not marked and (page, command) not in run]
    assert not unaccounted, unaccounted
    stale = run - {(page, command) for page, command, _ in commands}
    assert not stale, f"the docs no longer show {stale}"


def tiny(command: str) -> list[str]:
    """The command as an argv for this checkout's Python, plus the flags that make it tiny."""
    argv = shlex.split(command.split("|")[-1])
    assert argv[0] == ".venv/bin/python" and argv[1] == "-m", argv
    return [sys.executable, *argv[1:], *TINY.get(argv[2], [])]


def stdin_of(command: str) -> str | None:
    if "|" not in command:
        return None
    return subprocess.run(command.split("|")[0], shell=True, capture_output=True, text=True, check=True).stdout


@pytest.mark.slow
def test_the_docs_pipeline_runs_at_tiny_size(tmp_path: Path) -> None:
    env = cli_env()
    first = subprocess.run([sys.executable, "-m", "lit_minimind.fit", *FIT_TINY], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=600)  # make fit's run: out/pretrain_128.pth
    assert first.returncode == 0, first.stderr[-3000:]
    for page, command in RUN:
        argv = tiny(command)
        if argv[2] == "lit_minimind.serve":
            server = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True)
            try:
                match = LISTENING.search(server.stdout.readline())
                assert match, (page, command, server.stderr.read() if server.poll() is not None else "")
                request = urllib.request.Request(match.group(1) + "/v1/models",
                                                 headers={"Authorization": "Bearer sk-mine"})
                with urllib.request.urlopen(request, timeout=60) as reply:  # noqa: S310 - the loopback server above
                    assert reply.status == 200
            finally:
                server.terminate()
                server.wait(timeout=60)
            continue
        done = subprocess.run(argv, cwd=tmp_path, env=env, input=stdin_of(command), capture_output=True, text=True,
                              timeout=900)
        assert done.returncode == 0, (page, command, done.stderr[-3000:])
        if argv[2] == "lit_minimind.generate":
            assert done.stdout.strip(), (page, command)  # an answer was printed
    for written in ("out/full_sft_128.pth", "out/lora_pydoc_128.pth", "out/lora_pydoc_128_merged.pth", "out/dpo_128.pth",
                    "out/reward_128.pth", "out/grpo_128.pth", "out/ppo_actor_128.pth", "out/agent_128.pth", "out/full_dist_64.pth", "hf/minimind/config.json",
                    "hf/minimind-f32/config.json"):
        assert (tmp_path / written).is_file(), written
