"""spade_jax: SPADE adaptive environment self-play and MoE router steering in JAX/Flax."""

__version__ = "0.1.0"
