"""Qwen3-family models: architecture, config, Hugging Face conversion."""

from spade_jax.models.config import PRESETS, ConfigError, ModelConfig, preset
from spade_jax.models.hf_io import abstract_model, load_hf, save_hf
from spade_jax.models.moe import load_balancing_loss
from spade_jax.models.qwen3 import KVCache, ModelOptions, ModelOutput, Qwen3, positions_from_mask
from spade_jax.models.safetensors_io import CheckpointError

__all__ = [
    "PRESETS", "CheckpointError", "ConfigError", "KVCache", "ModelConfig", "ModelOptions",
    "ModelOutput", "Qwen3", "abstract_model", "load_balancing_loss", "load_hf",
    "positions_from_mask", "preset", "save_hf",
]
