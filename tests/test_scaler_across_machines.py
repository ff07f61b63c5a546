"""A checkpoint written by the CPU fp16 plugin restores its loss scale into Lightning's CUDA
``16-mixed`` plugin, and back, through the plugins' own ``state_dict`` / ``load_state_dict`` (what
Lightning calls under the plugin's class name). Without a GPU, torch turns a CUDA GradScaler off;
then its state dict is checked against a CPU GradScaler loading it (GradScaler's state holds no device)."""

from __future__ import annotations

import warnings

import torch
from lightning.pytorch.plugins import MixedPrecision

from lit_minimind.model.precision import CPUFloat16Mixed
from lit_minimind.resume.internals import adopt_scaler_state


def cuda_plugin() -> MixedPrecision:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "CUDA is not available. Disabling" on a machine without a GPU
        return MixedPrecision("16-mixed", "cuda", scaler=torch.amp.GradScaler("cuda", enabled=torch.cuda.is_available()))


def moved_cpu_plugin() -> CPUFloat16Mixed:
    """A CPU fp16 plugin whose scaler met an inf gradient: its scale backed off from 1024 to 512."""
    plugin = CPUFloat16Mixed(init_scale=1024.0)
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    plugin.scaler.scale((w * float("inf")).sum()).backward()
    plugin.scaler.step(opt)
    plugin.scaler.update()
    assert plugin.scaler.get_scale() == 512.0
    return plugin


def lightning_checkpoint(plugin: MixedPrecision) -> dict:
    """The keys a lit-minimind checkpoint holds for the scaler: Lightning's (plugin class name) and MiniMind's."""
    return {type(plugin).__qualname__: plugin.state_dict(), "scaler": plugin.scaler.state_dict()}


def restore(plugin: MixedPrecision, checkpoint: dict) -> None:
    """What ResumeCallback.on_load_checkpoint, then Lightning's precision restore, do."""
    adopt_scaler_state(checkpoint, plugin)
    plugin.load_state_dict(checkpoint[type(plugin).__qualname__])


def test_cpu_fp16_checkpoint_restores_its_scale_into_cuda_16_mixed_and_back() -> None:
    written = lightning_checkpoint(moved_cpu_plugin())
    assert "MixedPrecision" not in written  # Lightning alone would not restore the scale on the GPU

    cuda = cuda_plugin()
    restore(cuda, written)
    if torch.cuda.is_available():
        assert cuda.scaler.get_scale() == 512.0
    state = written["MixedPrecision"]
    assert state["scale"] == 512.0 and set(state) == set(torch.amp.GradScaler("cpu").state_dict())
    stand_in = torch.amp.GradScaler("cpu")
    stand_in.load_state_dict(state)
    assert stand_in.get_scale() == 512.0

    # back: a checkpoint of the CUDA run (its scaler's state, here the same dict) into the CPU fp16 plugin
    from_gpu = {"MixedPrecision": dict(state), "scaler": dict(state)}
    cpu = CPUFloat16Mixed()
    assert cpu.scaler.get_scale() == 2.0**16
    restore(cpu, from_gpu)
    assert cpu.scaler.get_scale() == 512.0 and cpu.state_dict() == state


def test_no_scaler_no_state() -> None:
    checkpoint = {"scaler": {}}
    adopt_scaler_state(checkpoint, MixedPrecision("bf16-mixed", "cpu"))
    assert checkpoint == {"scaler": {}}
    checkpoint = {"scaler": {"scale": 8.0}}
    adopt_scaler_state(checkpoint, MixedPrecision("bf16-mixed", "cpu"))  # bf16: no scaler to restore
    assert "MixedPrecision" not in checkpoint
