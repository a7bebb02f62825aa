"""Models for the recipes: an embedded GPT-2-style model and a local Hugging Face causal-LM loader."""

from lightning_nvme.models.gpt import GPT, GPTConfig
from lightning_nvme.models.lightning_modules import CausalLMModule, GPTLightningModule, HFCausalLM

__all__ = ["GPT", "GPTConfig", "CausalLMModule", "GPTLightningModule", "HFCausalLM"]
