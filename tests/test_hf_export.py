"""``python -m lit_minimind.export``: the Hugging Face directory, without transformers.

What MiniMind's own converter writes is kept in ``tests/fixtures/hf/minimind_converter.json`` (how it
was made: ``make_minimind_converter.py`` beside it); the checks with transformers itself are in
``test_hf_transformers.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lit_minimind.checkpoint.hf import minimind_fields
from lit_minimind.checkpoint.read import read_checkpoint
from lit_minimind.checkpoint.weights import model_weights
from lit_minimind.cli import generate
from lit_minimind.cli.export import export_hf
from lit_minimind.cli.export import main as export_main
from lit_minimind.cli.from_weight import load_start_weights, weight_path
from lit_minimind.data.chat_template import load_chat_template
from lit_minimind.errors import CheckpointError
from lit_minimind.model.module import LitMiniMind
from tests.helpers.runs import MINIMIND, ROOT, TOKENIZER, cli_env, need_shared, run_cli, tiny_args

FIXTURE = json.loads((ROOT / "tests" / "fixtures" / "hf" / "minimind_converter.json").read_text())
PARITY = MINIMIND / "parity"
RUN = MINIMIND / "original_run"


def sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), k


@pytest.fixture(autouse=True)
def _shared() -> None:
    need_shared()


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_export_equals_minimind_converter(tmp_path: Path, kind: str) -> None:
    """Same MiniMind weights: our config.json and every tensor equal what MiniMind's converter wrote."""
    out = tmp_path / "hf"
    export_hf(PARITY / f"{kind}_weights.pth", out, tokenizer_path=TOKENIZER)
    expected = FIXTURE[kind]
    assert json.loads((out / "config.json").read_text()) == expected["config.json"]
    tensors = load_file(out / "model.safetensors")
    assert {k: [list(v.shape), str(v.dtype).removeprefix("torch."), sha256(v)] for k, v in tensors.items()} \
        == expected["tensors"]
    assert sorted(p.name for p in out.iterdir()) == expected["files"]
    tok = json.loads((out / "tokenizer_config.json").read_text())
    for key in ("tokenizer_class", "extra_special_tokens", "bos_token", "eos_token", "pad_token", "unk_token"):
        assert tok[key] == expected["tokenizer_config.json"][key], key
    assert tok["chat_template"] == (out / "chat_template.jinja").read_text() == load_chat_template(TOKENIZER)
    assert (out / "tokenizer.json").read_bytes() == (TOKENIZER / "tokenizer.json").read_bytes()
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2


@pytest.mark.parametrize("source,dtype", [("out__pretrain_64.pth", "float16"), ("out__pretrain_64_moe.pth", "float16"),
                                          ("checkpoints__pretrain_64_moe_resume.step5.pth", "float16")])
def test_round_trip_is_bit_identical(tmp_path: Path, source: str, dtype: str) -> None:
    """ours -> HF -> ours: the same keys, dtypes and bits, read through the one weights reader."""
    src = RUN / source
    export_hf(src, tmp_path / "hf", dtype=dtype)
    back = model_weights(read_checkpoint(tmp_path / "hf"))
    assert_same_weights(back, dict(model_weights(read_checkpoint(src))))
    assert back["lm_head.weight"] is back["model.embed_tokens.weight"]  # tied, as in the model


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_round_trip_other_dtypes(tmp_path: Path, dtype: str) -> None:
    weights = torch.load(PARITY / "moe_weights.pth", weights_only=True)
    weights = {k: v.to(getattr(torch, dtype)) for k, v in weights.items()}
    src = tmp_path / "w.pth"
    torch.save(weights, src)
    export_hf(src, tmp_path / "hf", dtype=dtype)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == dtype
    assert_same_weights(model_weights(read_checkpoint(tmp_path / "hf")), weights)


def test_stacked_experts_are_read(tmp_path: Path) -> None:
    """transformers' in-memory layout (experts stacked into gate_up_proj / down_proj) reads back the same."""
    export_hf(RUN / "out__pretrain_64_moe.pth", tmp_path / "hf")
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    for layer in range(2):
        p = f"model.layers.{layer}.mlp.experts"
        gate = torch.stack([tensors.pop(f"{p}.{e}.gate_proj.weight") for e in range(4)])
        up = torch.stack([tensors.pop(f"{p}.{e}.up_proj.weight") for e in range(4)])
        tensors[f"{p}.gate_up_proj"] = torch.cat([gate, up], dim=1)
        tensors[f"{p}.down_proj"] = torch.stack([tensors.pop(f"{p}.{e}.down_proj.weight") for e in range(4)])
    save_file(tensors, tmp_path / "hf" / "model.safetensors")
    assert_same_weights(model_weights(read_checkpoint(tmp_path / "hf")),
                        dict(model_weights(read_checkpoint(RUN / "out__pretrain_64_moe.pth"))))


def test_from_weight_and_generate_take_the_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = RUN / "out__pretrain_64.pth"
    export_hf(src, tmp_path / "hf", tokenizer_path=TOKENIZER)
    assert weight_path(str(tmp_path / "hf"), "out", 64, False) == tmp_path / "hf"
    model = LitMiniMind(hidden_size=64, num_hidden_layers=2)
    report = load_start_weights(model, tmp_path / "hf")
    assert "missing keys: none; unexpected keys: none" in report
    assert_same_weights({k: v.half() for k, v in model.model.state_dict().items() if "freqs" not in k},
                        dict(model_weights(read_checkpoint(src))))
    args = ["--prompt", "Once upon a time", "--temperature", "0", "--max_new_tokens", "16"]
    capsys.readouterr()
    assert generate.main([str(tmp_path / "hf"), *args]) == 0  # the directory's own tokenizer
    from_dir = capsys.readouterr().out
    assert generate.main([str(src), "--tokenizer_path", str(TOKENIZER), *args]) == 0
    assert from_dir == capsys.readouterr().out and from_dir.startswith("Once upon a time")
    edited_config(tmp_path, rope_theta=10000.0)
    with pytest.raises(CheckpointError, match=r"rope_theta: config.json 10000.0, this run 1000000.0"):
        load_start_weights(model, tmp_path / "hf")


def cli_error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """Run the export CLI in-process: it must fail with exit code 2 and one line on stderr."""
    capsys.readouterr()
    assert export_main(list(args)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def test_existing_directory_refused_unless_overwrite(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "hf"
    assert export_main([str(RUN / "out__pretrain_64.pth"), str(out)]) == 0
    before = (out / "model.safetensors").read_bytes()
    assert "--overwrite" in cli_error(capsys, str(RUN / "out__pretrain_64_moe.pth"), str(out))
    assert (out / "model.safetensors").read_bytes() == before
    assert export_main([str(RUN / "out__pretrain_64_moe.pth"), str(out), "--overwrite"]) == 0
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3_moe"
    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    assert "not an earlier export" in cli_error(capsys, str(RUN / "out__pretrain_64.pth"), str(other), "--overwrite")
    assert sorted(p.name for p in other.iterdir()) == ["keep.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "notes"]  # no tmp or old directory left


def test_killed_export_leaves_no_directory(tmp_path: Path) -> None:
    """SIGKILL with every file written but before the rename: DIR does not exist; the next export works."""
    out = tmp_path / "hf"
    proc = subprocess.Popen([sys.executable, "-m", "lit_minimind.export", str(RUN / "out__pretrain_64.pth"), str(out)],
                            cwd=ROOT, env=cli_env(LIT_MINIMIND_TEST_STOP_IN_SAVE="1:directory"), stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("@@stopped-in-save"), line
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    assert not out.exists()
    assert export_main([str(RUN / "out__pretrain_64.pth"), str(out)]) == 0
    assert (out / "model.safetensors").is_file()


def test_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = str(tmp_path / "out")
    assert "no such checkpoint file" in cli_error(capsys, str(tmp_path / "missing.pth"), out)
    torch.save({"something": torch.zeros(3)}, tmp_path / "other.pth")
    assert "no MiniMind weights" in cli_error(capsys, str(tmp_path / "other.pth"), out)
    assert "does not exist" in cli_error(capsys, str(RUN / "out__pretrain_64.pth"), out, "--tokenizer_path",
                                         str(tmp_path / "nowhere"))
    weights = torch.load(RUN / "out__pretrain_64.pth", weights_only=True)
    del weights["model.layers.1.self_attn.k_norm.weight"]
    torch.save(weights, tmp_path / "cut.pth")
    assert "missing tensor model.layers.1.self_attn.k_norm.weight" in cli_error(capsys, str(tmp_path / "cut.pth"), out)
    weights = torch.load(RUN / "out__pretrain_64.pth", weights_only=True)
    weights["lm_head.weight"] = weights["lm_head.weight"] + 1
    torch.save(weights, tmp_path / "untied.pth")
    assert "lm_head.weight differs" in cli_error(capsys, str(tmp_path / "untied.pth"), out)
    assert not (tmp_path / "out").exists()


def edited_config(tmp_path: Path, **changes: object) -> Path:
    out = tmp_path / "hf"
    if not out.exists():
        export_hf(RUN / "out__pretrain_64_moe.pth", out)
    config = json.loads((out / "config.json").read_text())
    config.update(changes)
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("changes,message", [
    ({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, "model_type 'llama' (LlamaForCausalLM) is not Qwen3"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling is"),
    ({"hidden_act": "gelu"}, "hidden_act is \"gelu\""),
    ({"head_dim": 16}, "head_dim is 16"),
    ({"num_local_experts": 8}, "missing tensor model.layers.0.mlp.experts.4.gate_proj.weight"),
    ({"num_experts_per_tok": 2, "moe_intermediate_size": 128}, "shape model.layers.0.mlp.experts.0.gate_proj.weight (256, 64), expected (128, 64)"),
    ({"hidden_size": 128}, "head_dim is 8; MiniMind's model needs 16"),
])
def test_foreign_directory_is_one_line(tmp_path: Path, changes: dict, message: str,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    out = edited_config(tmp_path, **changes)
    with pytest.raises(CheckpointError) as err:
        read_checkpoint(out)
    assert message in str(err.value) and "\n" not in str(err.value)
    capsys.readouterr()
    assert generate.main([str(out), "--prompt", "hi"]) == 2
    assert message in capsys.readouterr().err


def test_missing_tensor_in_directory_is_named(tmp_path: Path) -> None:
    out = edited_config(tmp_path)
    tensors = load_file(out / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(tensors, out / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight"):
        read_checkpoint(out)
    (out / "model.safetensors").write_bytes(b"\x00" * 5)
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        read_checkpoint(out)


def test_package_imports_and_exports_without_transformers(tmp_path: Path) -> None:
    """``python -m lit_minimind.export`` with transformers made unimportable: it is never needed."""
    argv = ["lit_minimind.export", str(RUN / "out__pretrain_64.pth"), str(tmp_path / "hf")]
    code = ("import runpy, sys; sys.modules['transformers'] = None\n"  # any import of it raises ImportError
            "import lit_minimind.cli.fit, lit_minimind.cli.generate\n"
            f"sys.argv = {argv!r}; runpy.run_module('lit_minimind.export', run_name='__main__')")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=cli_env(), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("exported ") and (tmp_path / "hf" / "model.safetensors").is_file()


def test_minimind_fields_of_a_config_without_rope_theta_edit() -> None:
    """transformers >= 5 writes rope_parameters instead of rope_theta unless the converter edits it."""
    config = dict(FIXTURE["dense"]["config.json"])
    del config["rope_theta"], config["rope_scaling"]
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    assert minimind_fields(config, "config.json")["rope_theta"] == 10000.0


def test_fit_export_hf_writes_the_final_weights(tmp_path: Path) -> None:
    """``fit --export_hf DIR``: after the final save, DIR holds the final fp16 weights and the run's tokenizer;
    the run's .ckpt exports the same (its recorded tokenizer)."""
    hf = tmp_path / "hf"
    run = run_cli(tmp_path, tiny_args("--trainer.max_steps", "2", "--export_hf", str(hf)))
    assert run.returncode == 0, run.stderr[-2000:]
    assert f"Hugging Face export: {hf}/ (from out/pretrain_64.pth)" in run.stdout
    final = tmp_path / "out" / "pretrain_64.pth"
    assert_same_weights(model_weights(read_checkpoint(hf)), dict(model_weights(read_checkpoint(final))))
    assert (hf / "tokenizer.json").read_bytes() == (TOKENIZER / "tokenizer.json").read_bytes()
    ckpt = next((tmp_path / "checkpoints").glob("*.ckpt"))
    export_hf(ckpt, tmp_path / "from_ckpt")
    assert (tmp_path / "from_ckpt" / "model.safetensors").read_bytes() == (hf / "model.safetensors").read_bytes()
    assert (tmp_path / "from_ckpt" / "tokenizer.json").read_bytes() == (TOKENIZER / "tokenizer.json").read_bytes()
