"""Tiny random Hugging Face Qwen3-family checkpoints, built and saved by the tests.

``transformers`` is the reference implementation; nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

VOCAB = 96


def hf_config(kind: str, **overrides):
    """A tiny transformers config. kind: 'dense', 'moe' (Qwen3-MoE), 'shared' (Qwen2-MoE)."""
    from transformers import Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=40, rms_norm_eps=1e-6,
        max_position_embeddings=256, rope_theta=10000.0, initializer_range=0.1,
        tie_word_embeddings=False,
    )
    if kind == "dense":
        cls, extra = Qwen3Config, {}
    elif kind == "moe":
        cls, extra = Qwen3MoeConfig, dict(num_experts=8, num_experts_per_tok=2,
                                          moe_intermediate_size=24, norm_topk_prob=True)
    elif kind == "shared":
        cls, extra = Qwen2MoeConfig, dict(num_experts=8, num_experts_per_tok=2,
                                          moe_intermediate_size=24, norm_topk_prob=False,
                                          shared_expert_intermediate_size=36, qkv_bias=True)
    else:
        raise ValueError(kind)
    return cls(**{**common, **extra, **overrides})


def make_hf_model(kind: str, path: Path | None = None, seed: int = 0, **overrides):
    """A random tiny model (eval mode, fp32); saved to ``path`` when given."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(kind, **overrides)).eval()
    with torch.no_grad():  # biases and norms start at 0/1; randomise so they are tested
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    if path is not None:
        model.save_pretrained(path)
    return model


def hf_logits(model, ids: np.ndarray, attention_mask: np.ndarray | None = None,
              position_ids: np.ndarray | None = None):
    with torch.no_grad():
        out = model(
            torch.tensor(ids),
            attention_mask=None if attention_mask is None else torch.tensor(attention_mask),
            position_ids=None if position_ids is None else torch.tensor(position_ids),
            output_router_logits=hasattr(model.config, "num_experts"),
        )
    return out
