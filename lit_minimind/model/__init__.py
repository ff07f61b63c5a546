"""What is trained: MiniMind's transformer (:mod:`.minimind`), its LightningModule (:mod:`.module`) and
the CPU fp16 precision plugin (:mod:`.precision`)."""

from lit_minimind.model.minimind import CausalLMOutput, MiniMindConfig, MiniMindForCausalLM

__all__ = ["CausalLMOutput", "MiniMindConfig", "MiniMindForCausalLM"]
