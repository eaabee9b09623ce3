"""The optimizer of the policy update: AdamW with warmup + cosine/constant learning rate and
global-norm gradient clipping, built from one frozen config.

    lr(s) = peak * (s + 1) / warmup                             s < warmup (s = 0, 1, ...)
          = peak * (end + (1 - end) * (1 + cos(pi * p)) / 2)     cosine, p = (s - warmup) /
                                                                  (total - warmup) in [0, 1]
          = peak                                                 constant

(The first update already uses peak / warmup, not 0.)

Weight decay is decoupled (AdamW) and chosen by what a parameter is, from its name: norm
scales (a module named ``*norm``) and biases are not decayed, everything else is (as
Megatron's no-decay rule for the recipe's norms and biases). Never by the number of
dimensions: under ``scan_layers`` a stacked norm weight is 2-D and still a norm.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

SCHEDULES = ("cosine", "constant")
MASTER_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW settings.

    Attributes:
      learning_rate: peak learning rate (reached at the end of warmup).
      warmup_steps: linear warmup from 0 over this many updates (0 = start at the peak).
      schedule: "cosine" (decay to ``end_lr_ratio * learning_rate`` at ``total_steps``) or
        "constant" (stay at the peak after warmup).
      total_steps: length of the cosine schedule, in updates; must exceed ``warmup_steps``
        for "cosine". None (default): the run's length, filled in by :meth:`for_run` where
        the run builds its optimizer (``spade_jax.experiment.train_config_for_run``: one
        update per SPADE round), so it never drifts from ``spade.rounds``.
      end_lr_ratio: final / peak learning rate of the cosine schedule.
      b1, b2, eps: Adam moment decays and denominator epsilon.
      weight_decay: decoupled weight decay on every parameter but norms and biases
        (:func:`decays`).
      clip_norm: clip the global gradient norm to this value before Adam; 0 disables.
      master_dtype: storage dtype of the parameters and of the Adam moments ("float32" keeps
        fp32 master weights even when the forward pass runs in bf16).
    """

    learning_rate: float = 1e-6
    warmup_steps: int = 0
    schedule: str = "constant"
    total_steps: int | None = None
    end_lr_ratio: float = 0.1
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    clip_norm: float = 1.0
    master_dtype: str = "float32"

    def __post_init__(self) -> None:
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.total_steps is not None and self.total_steps < 1:
            raise ValueError(f"total_steps must be >= 1 or None (the run's length), got "
                             f"{self.total_steps}")
        if (self.schedule == "cosine" and self.total_steps is not None
                and self.total_steps <= self.warmup_steps):
            raise ValueError(
                f"cosine schedule needs total_steps > warmup_steps, got total_steps="
                f"{self.total_steps}, warmup_steps={self.warmup_steps}"
            )
        if not 0 <= self.end_lr_ratio <= 1:
            raise ValueError(f"end_lr_ratio must be in [0, 1], got {self.end_lr_ratio}")
        for name in ("b1", "b2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.eps <= 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if self.clip_norm < 0:
            raise ValueError(f"clip_norm must be >= 0 (0 disables clipping), got {self.clip_norm}")
        if self.master_dtype not in MASTER_DTYPES:
            raise ValueError(
                f"master_dtype must be one of {sorted(MASTER_DTYPES)}, got {self.master_dtype!r}"
            )


    def for_run(self, total_updates: int) -> OptimizerConfig:
        """This config with ``total_steps`` = ``total_updates`` when it was left None."""
        if self.total_steps is not None:
            return self
        return dataclasses.replace(self, total_steps=total_updates)


def learning_rate_schedule(cfg: OptimizerConfig) -> optax.Schedule:
    """Update index s (0-based) -> learning rate, as in the module docstring."""
    if cfg.schedule == "cosine" and cfg.total_steps is None:
        raise ValueError("the cosine schedule needs total_steps: set it, or build the "
                         "optimizer from OptimizerConfig.for_run(run length)")

    def schedule(step):
        s = jnp.asarray(step, jnp.float32)
        warmup = jnp.minimum((s + 1.0) / max(cfg.warmup_steps, 1), 1.0)
        if cfg.schedule == "constant":
            return cfg.learning_rate * warmup
        progress = jnp.clip((s - cfg.warmup_steps) / (cfg.total_steps - cfg.warmup_steps), 0, 1)
        cosine = cfg.end_lr_ratio + (1 - cfg.end_lr_ratio) * 0.5 * (1 + jnp.cos(jnp.pi * progress))
        return cfg.learning_rate * jnp.where(s < cfg.warmup_steps, warmup, cosine)

    return schedule


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def decays(path: Sequence[Any]) -> bool:
    """Whether the parameter at ``path`` (a pytree key path, or its names) gets weight
    decay: not when a part of its name ends in "norm" (RMSNorm scales: ``final_norm``,
    ``input_norm``, ``q_norm``, ...) or contains "bias"."""
    names = [_key_name(k).lower() for k in path]
    return not any(n.endswith("norm") or "bias" in n for n in names)


def decay_mask(params: Any) -> Any:
    """Per leaf of ``params``: True where weight decay applies (:func:`decays`)."""
    return jax.tree_util.tree_map_with_path(lambda path, _: decays(path), params)


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW with the schedule; moments in ``master_dtype``."""
    adamw = optax.adamw(
        learning_rate=learning_rate_schedule(cfg),
        b1=cfg.b1,
        b2=cfg.b2,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        mu_dtype=MASTER_DTYPES[cfg.master_dtype],
        mask=decay_mask,
    )
    if cfg.clip_norm == 0:
        return adamw
    return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), adamw)
