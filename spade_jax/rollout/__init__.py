"""Rollouts: batched jitted sampling and the multi-turn agent loop.

    from spade_jax.rollout import generate
    out = generate(model, prompts, max_new_tokens=64, temperature=1.0, top_p=0.95)
"""

from spade_jax.rollout.sampler import (
    DONE_REASONS,
    GenerationResult,
    SamplerConfig,
    generate,
    sample,
)

__all__ = ["DONE_REASONS", "GenerationResult", "SamplerConfig", "generate", "sample"]
